//! A test engine gRPC server for sidecar mode, written straight on hyper so that it controls
//! every frame: when headers go out, each message's bytes, trailers (with
//! `grpc-status-details-bin`), deadlines, and whether a client's cancel reached it.
//!
//! Methods are matched by name on any service (`/<any service>/<Method>`):
//!
//! | method | kind | behaviour |
//! |---|---|---|
//! | `Echo` | unary | answers the request message; response headers echo the request's `x-*` metadata as `echo-x-*`, and `grpc-timeout` as `echo-grpc-timeout` |
//! | `Generate` | server streaming | request = count u32 LE, size u32 LE; answers `count` messages of [`generate_message`] |
//! | `Ticks` | server streaming | request = count u32 LE, interval µs u32 LE; answers `count` 64-byte messages, one per interval, each starting with the Unix ns at which it was sent (u64 LE) |
//! | `Fail` | unary | one message, then trailers `grpc-status` 9, a message and `grpc-status-details-bin` |
//! | `Slow` | unary | waits for the request's `grpc-timeout` to pass, then answers `DEADLINE_EXCEEDED` itself |
//! | `Hang` | server streaming | one message, then waits until the client goes away and counts it in `cancelled` |
//! | `Sum` | client streaming | answers (messages u64 LE, bytes u64 LE) of the request stream |
//! | `Chat` | bidi | answers each message with the same bytes as it arrives |
//! | `HealthCheck` | unary | only on `vllm.grpc.engine.VllmEngine`: `healthy = true`; other services: `UNIMPLEMENTED` |
//! | `GetLoads` | unary | only on vLLM: one `SchedulerLoad` with `num_running_reqs` = [`Stats::running`] |
//! | anything else | — | trailers-only `UNIMPLEMENTED` naming the method |
//!
//! It listens on plain TCP ([`GrpcEngine::start`]) or TLS ([`GrpcEngine::start_tls`]); both serve
//! each connection with the same [`serve_connection`].
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The details blob `Fail` sends (base64 of bytes 0..=9 in `grpc-status-details-bin`).
pub const FAIL_DETAILS: &[u8] = &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9];

/// Counters the tests read.
#[derive(Default)]
pub struct Stats {
    /// Calls received, any method.
    pub calls: AtomicU64,
    /// `Hang` calls whose client went away.
    pub cancelled: AtomicU64,
    /// `Generate` calls received.
    pub generates: AtomicU64,
    /// `Slow` calls received.
    pub slows: AtomicU64,
    /// What `GetLoads` reports as running requests.
    pub running: AtomicU32,
    /// TLS handshakes that failed or did not agree on ALPN `h2` ([`GrpcEngine::start_tls`] only).
    pub tls_failed: AtomicU64,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` for connections accepted from now on (0: `u32::MAX`).
    pub max_streams: AtomicU32,
    /// Request header bytes received (names and values, all calls).
    pub header_bytes: AtomicU64,
    /// HTTP/2 receive window per stream for connections accepted from now on (0: 4 MiB).
    pub stream_window: AtomicU32,
    /// `notify_waiters()`: every open connection sends GOAWAY and drains (its open streams go
    /// on, no new one is accepted), as a server shutting down gracefully, or an h2 or grpcio
    /// server that judged a burst of reset streams abuse; new connections are served.
    pub drain: tokio::sync::Notify,
}

/// A running test engine.
pub struct GrpcEngine {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    task: tokio::task::JoinHandle<()>,
}

/// Message `i` of a `Generate` stream of `size`-byte messages: deterministic, distinct.
pub fn generate_message(i: u32, size: u32) -> Bytes {
    let mut b = BytesMut::with_capacity(size as usize);
    let mut x = i.wrapping_mul(2_654_435_761).wrapping_add(12345);
    while b.len() < size as usize {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        b.put_u8((x & 0xff) as u8);
    }
    b.freeze()
}

/// Wall-clock Unix nanoseconds (the engine and the client share the machine's clock).
pub fn unix_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// One gRPC length-prefixed message.
pub fn frame(msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.put_u8(0);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

type Tx = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Infallible>>;
type RespBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn trailers(code: i32, message: &str) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from(code));
    if !message.is_empty() {
        t.insert("grpc-message", HeaderValue::from_str(message).unwrap());
    }
    t
}

fn trailers_only(code: i32, message: &str) -> Response<RespBody> {
    let mut r = Response::new(http_body_util::Empty::new().boxed());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    r.headers_mut().extend(trailers(code, message));
    r
}

fn grpc_timeout(h: &HeaderMap) -> Option<Duration> {
    let v = h.get("grpc-timeout")?.to_str().ok()?;
    let (n, unit) = v.split_at(v.len() - 1);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The vLLM `GetLoadsResponse` with one rank.
fn get_loads_response(running: u32) -> Vec<u8> {
    // SchedulerLoad { dp_rank = 0 (1), num_running_reqs (2), num_waiting_reqs (3) = 2,
    // token_usage (7) = 0.5, max_running_requests (11) = 128 }
    let mut load = Vec::new();
    prost::encoding::int32::encode(2, &(running as i32), &mut load);
    prost::encoding::int32::encode(3, &2, &mut load);
    prost::encoding::double::encode(7, &0.5, &mut load);
    prost::encoding::int32::encode(11, &128, &mut load);
    let mut resp = Vec::new();
    prost::encoding::int32::encode(3, &1, &mut resp);
    prost::encoding::bytes::encode(4, &load, &mut resp);
    resp
}

impl GrpcEngine {
    /// Starts on `addr` (port 0: a fresh one).
    pub async fn start(addr: SocketAddr) -> GrpcEngine {
        Self::start_with(addr, Arc::new(Stats::default())).await
    }

    /// Starts on `addr`, sharing `stats` (for restarts).
    pub async fn start_with(addr: SocketAddr, stats: Arc<Stats>) -> GrpcEngine {
        Self::listen(addr, stats, None).await
    }

    /// Starts on `addr` speaking TLS (ALPN `h2`) with the certificate chain and private key in
    /// `cert_pem` / `key_pem`, then the same gRPC methods as [`GrpcEngine::start`]. A connection
    /// whose handshake fails, or that did not agree on `h2`, is counted in [`Stats::tls_failed`]
    /// and closed.
    pub async fn start_tls(addr: SocketAddr, cert_pem: &str, key_pem: &str) -> GrpcEngine {
        let acceptor = tls_acceptor(cert_pem, key_pem);
        Self::listen(addr, Arc::new(Stats::default()), Some(acceptor)).await
    }

    async fn listen(
        addr: SocketAddr,
        stats: Arc<Stats>,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> GrpcEngine {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = stats.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let _ = sock.set_nodelay(true);
                let st = st.clone();
                let tls = tls.clone();
                // The handshake runs in the connection's task, so a slow or failing one never
                // holds up the accept loop.
                conns.spawn(async move {
                    match tls {
                        None => serve_connection(sock, st).await,
                        Some(acceptor) => match acceptor.accept(sock).await {
                            // Like grpc-go (≥ 1.67): a client that did not agree on ALPN `h2`
                            // is refused, so a client must offer it to be served.
                            Ok(tls) if tls.get_ref().1.alpn_protocol() == Some(b"h2") => {
                                serve_connection(tls, st).await
                            }
                            _ => {
                                st.tls_failed.fetch_add(1, Ordering::SeqCst);
                            }
                        },
                    }
                });
            }
        });
        GrpcEngine { addr, stats, task }
    }

    /// Stops listening and drops every connection (the process "dies").
    pub fn stop(self) -> (SocketAddr, Arc<Stats>) {
        self.task.abort();
        (self.addr, self.stats.clone())
    }
}

impl Drop for GrpcEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one HTTP/2 connection (plain TCP or TLS) with [`handle`] until it closes.
async fn serve_connection<IO>(io: IO, st: Arc<Stats>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let max_streams = match st.max_streams.load(Ordering::SeqCst) {
        0 => u32::MAX,
        n => n,
    };
    let stream_window = match st.stream_window.load(Ordering::SeqCst) {
        0 => 4 << 20,
        n => n,
    };
    let drain = st.clone();
    let svc = hyper::service::service_fn(move |req| {
        let st = st.clone();
        async move { Ok::<_, Infallible>(handle(st, req).await) }
    });
    // Like grpcio: no stream limit worth mentioning, and windows large enough that h2's
    // small-DATA-frame budget (half the connection window) never closes the connection while
    // 1,000 small requests wait to be read.
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(max_streams)
        .initial_stream_window_size(stream_window)
        .initial_connection_window_size(1 << 30)
        .serve_connection(TokioIo::new(io), svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        () = drain.drain.notified() => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// A rustls server (ring provider, as kvbridge's own TLS) for `cert_pem` / `key_pem`, ALPN `h2`.
fn tls_acceptor(cert_pem: &str, key_pem: &str) -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("test engine: certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("test engine: key PEM");
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("test engine: certificate and key");
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

async fn handle(st: Arc<Stats>, req: Request<Incoming>) -> Response<RespBody> {
    st.calls.fetch_add(1, Ordering::Relaxed);
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    st.header_bytes
        .fetch_add(header_bytes as u64, Ordering::Relaxed);
    let path = req.uri().path().to_string();
    let Some((service, method)) = path[1..].split_once('/') else {
        return trailers_only(12, "test engine: bad path");
    };
    let (service, method) = (service.to_string(), method.to_string());
    let (parts, mut body) = req.into_parts();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(16);
    let mut resp =
        Response::new(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    // Reads the next complete request message (None at the end of the request).
    async fn next_message(body: &mut Incoming, buf: &mut BytesMut) -> Option<Bytes> {
        loop {
            if let Some(m) = take_messages_one(buf) {
                return Some(m);
            }
            match body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        buf.extend_from_slice(&d);
                    }
                }
                _ => return None,
            }
        }
    }
    fn take_messages_one(buf: &mut BytesMut) -> Option<Bytes> {
        if buf.len() < 5 {
            return None;
        }
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if buf.len() < 5 + len {
            return None;
        }
        buf.advance(5);
        Some(buf.split_to(len).freeze())
    }
    async fn send(tx: &Tx, msg: &[u8]) -> bool {
        tx.send(Ok(Frame::data(frame(msg)))).await.is_ok()
    }
    async fn end(tx: &Tx, code: i32, message: &str) {
        let _ = tx.send(Ok(Frame::trailers(trailers(code, message)))).await;
    }
    let mut buf = BytesMut::new();
    match method.as_str() {
        "Echo" => {
            for (k, v) in parts.headers.iter() {
                if k.as_str().starts_with("x-") {
                    let name = HeaderName::from_bytes(format!("echo-{k}").as_bytes()).unwrap();
                    resp.headers_mut().insert(name, v.clone());
                }
            }
            if let Some(v) = parts.headers.get("grpc-timeout") {
                resp.headers_mut().insert("echo-grpc-timeout", v.clone());
            }
            let msg = next_message(&mut body, &mut buf).await.unwrap_or_default();
            tokio::spawn(async move {
                send(&tx, &msg).await;
                end(&tx, 0, "").await;
            });
        }
        "Generate" => {
            st.generates.fetch_add(1, Ordering::Relaxed);
            let msg = next_message(&mut body, &mut buf).await.unwrap_or_default();
            let mut m = &msg[..];
            let (count, size) = if m.len() >= 8 {
                (m.get_u32_le(), m.get_u32_le())
            } else {
                (1, 16)
            };
            tokio::spawn(async move {
                for i in 0..count {
                    if !send(&tx, &generate_message(i, size)).await {
                        return;
                    }
                }
                end(&tx, 0, "").await;
            });
        }
        "Ticks" => {
            let msg = next_message(&mut body, &mut buf).await.unwrap_or_default();
            let mut m = &msg[..];
            let (count, every) = if m.len() >= 8 {
                (m.get_u32_le(), m.get_u32_le())
            } else {
                (1, 1000)
            };
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_micros(every.max(1) as u64));
                for _ in 0..count {
                    tick.tick().await;
                    let mut b = [0u8; 64];
                    b[..8].copy_from_slice(&unix_nanos().to_le_bytes());
                    if !send(&tx, &b).await {
                        return;
                    }
                }
                end(&tx, 0, "").await;
            });
        }
        "Fail" => {
            let _ = next_message(&mut body, &mut buf).await;
            tokio::spawn(async move {
                send(&tx, b"partial").await;
                let mut t = trailers(9, "test engine: precondition failed");
                let details = base64_encode(FAIL_DETAILS);
                t.insert(
                    "grpc-status-details-bin",
                    HeaderValue::from_str(&details).unwrap(),
                );
                t.insert("x-engine-trailer", HeaderValue::from_static("kept"));
                let _ = tx.send(Ok(Frame::trailers(t))).await;
            });
        }
        "Slow" => {
            st.slows.fetch_add(1, Ordering::Relaxed);
            let timeout = grpc_timeout(&parts.headers).unwrap_or(Duration::from_secs(30));
            tokio::spawn(async move {
                // The point of "Slow": an engine that answers only when the deadline has passed.
                tokio::time::sleep(timeout).await;
                end(&tx, 4, "test engine: deadline exceeded").await;
            });
        }
        "Hang" => {
            let _ = next_message(&mut body, &mut buf).await;
            tokio::spawn(async move {
                send(&tx, b"first").await;
                tx.closed().await;
                st.cancelled.fetch_add(1, Ordering::SeqCst);
            });
        }
        "Sum" => {
            tokio::spawn(async move {
                let (mut n, mut bytes) = (0u64, 0u64);
                while let Some(m) = next_message(&mut body, &mut buf).await {
                    n += 1;
                    bytes += m.len() as u64;
                }
                let mut out = Vec::new();
                out.extend_from_slice(&n.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
                send(&tx, &out).await;
                end(&tx, 0, "").await;
            });
        }
        "Chat" => {
            tokio::spawn(async move {
                while let Some(m) = next_message(&mut body, &mut buf).await {
                    if !send(&tx, &m).await {
                        return;
                    }
                }
                end(&tx, 0, "").await;
            });
        }
        "HealthCheck" if service == "vllm.grpc.engine.VllmEngine" => {
            tokio::spawn(async move {
                // HealthCheckResponse { healthy = true (1), message = "ok" (2) }
                send(&tx, &[0x08, 0x01, 0x12, 0x02, b'o', b'k']).await;
                end(&tx, 0, "").await;
            });
        }
        "GetLoads" if service == "vllm.grpc.engine.VllmEngine" => {
            let running = st.running.load(Ordering::Relaxed);
            tokio::spawn(async move {
                send(&tx, &get_loads_response(running)).await;
                end(&tx, 0, "").await;
            });
        }
        _ => {
            return trailers_only(12, &format!("test engine: no method {path}"));
        }
    }
    resp
}

/// Standard base64 with padding (gRPC's `-bin` headers accept it).
pub fn base64_encode(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// A tonic codec for raw message bytes: the tests call arbitrary paths without generated code.
#[derive(Clone, Copy, Default)]
pub struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Self::Error> {
        dst.put(item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Bytes>, Self::Error> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

/// A raw gRPC client on `channel` (64 MiB message limit each way).
pub fn raw_client(
    channel: tonic::transport::Channel,
) -> tonic::client::Grpc<tonic::transport::Channel> {
    tonic::client::Grpc::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

/// `/<service>/<method>` as a tonic path.
pub fn path(service: &str, method: &str) -> http::uri::PathAndQuery {
    format!("/{service}/{method}").parse().unwrap()
}
