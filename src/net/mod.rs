//! The TCP edge shared by the gRPC and metrics listeners: accepting without spinning when the
//! process runs out of descriptors, and (for gRPC) dropping connections that never start HTTP/2.
//!
//! **Accepting.** `accept(2)` fails with `EMFILE`/`ENFILE` while the descriptor limit is reached,
//! and keeps failing at once for as long as connections wait in the backlog: a loop that simply
//! retries burns a core and starves everything else. [`Acceptor`] instead counts every failure
//! (`kvbridge_accept_errors_total{listener, kind}`), logs at most one line per listener every
//! 10 s (with the number suppressed meanwhile) and, for listener-wide conditions, sleeps before
//! the next attempt: 100 ms, doubling up to 1 s while the condition lasts. Failures that concern
//! only the connection being accepted (reset or aborted by the peer) are retried at once.
//!
//! **Handshake timeout.** An accepted gRPC connection holds a descriptor, a task and its buffers.
//! [`EdgeIo`] gives it `--handshake-timeout-ms` to complete TLS (when configured) and to deliver
//! the HTTP/2 client preface (24 bytes) and its first SETTINGS frame; a connection that has not
//! done so by then fails with `TimedOut` and is closed. After that the connection is left to
//! HTTP/2's own keepalive.

pub(crate) mod h2io;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

/// First back-off after a listener-wide accept failure.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest back-off.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per listener this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// What an accept failure says (also the `kind` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptErrorKind {
    /// `EMFILE`: the process's descriptor limit is reached.
    Emfile,
    /// `ENFILE`: the system's descriptor limit is reached.
    Enfile,
    /// `ENOBUFS` / `ENOMEM`: the kernel is out of memory for sockets.
    NoMemory,
    /// The connection went away before it was accepted (reset, aborted, protocol error).
    Connection,
    /// Anything else.
    Other,
}

impl AcceptErrorKind {
    /// Every kind (the metric's label values).
    const ALL: [AcceptErrorKind; 5] = [
        Self::Emfile,
        Self::Enfile,
        Self::NoMemory,
        Self::Connection,
        Self::Other,
    ];

    /// Classifies an `accept(2)` error.
    pub fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EMFILE) => Self::Emfile,
            Some(libc::ENFILE) => Self::Enfile,
            Some(libc::ENOBUFS | libc::ENOMEM) => Self::NoMemory,
            Some(libc::ECONNABORTED | libc::ECONNRESET | libc::EPROTO | libc::EPERM)
            | Some(libc::EINTR | libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH) => {
                Self::Connection
            }
            _ => match e.kind() {
                io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted => Self::Connection,
                _ => Self::Other,
            },
        }
    }

    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Emfile => "emfile",
            Self::Enfile => "enfile",
            Self::NoMemory => "nomem",
            Self::Connection => "connection",
            Self::Other => "other",
        }
    }

    /// Whether the next `accept` would most likely fail the same way at once.
    fn lasts(self) -> bool {
        self != Self::Connection
    }
}

/// A listener whose [`accept`](Acceptor::accept) never returns an error and never spins.
pub struct Acceptor {
    listener: TcpListener,
    name: &'static str,
    errors: IntCounterVec,
    backoff: Duration,
    logged: Option<Instant>,
    suppressed: u64,
}

impl Acceptor {
    /// Accepts on `listener`; `name` is the `listener` label (`grpc`, `metrics`), `errors` the
    /// `kvbridge_accept_errors_total` family.
    pub fn new(listener: TcpListener, name: &'static str, errors: IntCounterVec) -> Self {
        // Every kind at 0 from the start, so that alerts see the first failure (`increase()`).
        for kind in AcceptErrorKind::ALL {
            errors.with_label_values(&[name, kind.label()]);
        }
        Acceptor {
            listener,
            name,
            errors,
            backoff: Duration::ZERO,
            logged: None,
            suppressed: 0,
        }
    }

    /// The next connection. Failures are counted, logged (rate-limited) and, when they concern
    /// the listener rather than one connection, followed by a growing pause.
    pub async fn accept(&mut self) -> TcpStream {
        loop {
            match self.listener.accept().await {
                Ok((sock, _)) => {
                    self.backoff = Duration::ZERO;
                    return sock;
                }
                Err(e) => {
                    let kind = AcceptErrorKind::of(&e);
                    self.errors
                        .with_label_values(&[self.name, kind.label()])
                        .inc();
                    if kind.lasts() {
                        self.backoff = (self.backoff * 2).clamp(BACKOFF_MIN, BACKOFF_MAX);
                    }
                    self.log(&e, kind);
                    if kind.lasts() {
                        tokio::time::sleep(self.backoff).await;
                    }
                }
            }
        }
    }

    fn log(&mut self, e: &io::Error, kind: AcceptErrorKind) {
        let now = Instant::now();
        if self
            .logged
            .is_some_and(|t| now.duration_since(t) < LOG_EVERY)
        {
            self.suppressed += 1;
            return;
        }
        let hint = match kind {
            AcceptErrorKind::Emfile | AcceptErrorKind::Enfile => {
                "out of file descriptors: raise the limit (LimitNOFILE) or close idle connections"
            }
            _ => "cannot accept connections",
        };
        tracing::warn!(listener = self.name, kind = kind.label(), error = %e,
            suppressed = self.suppressed, backoff_ms = self.backoff.as_millis() as u64, "{hint}");
        self.logged = Some(now);
        self.suppressed = 0;
    }
}

/// TLS for the gRPC listener: rustls with the `ring` provider, ALPN `h2`.
#[derive(Clone)]
pub struct Tls(tokio_rustls::TlsAcceptor);

impl Tls {
    /// From PEM: a certificate chain and its private key.
    pub fn from_pem(cert: &[u8], key: &[u8]) -> Result<Self, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("certificate: {e}"))?;
        if certs.is_empty() {
            return Err("certificate: no CERTIFICATE block".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("private key: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| e.to_string())?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Tls(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
    }
}

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Preface plus a frame header.
const HEAD: usize = PREFACE.len() + 9;
/// HTTP/2 frame type SETTINGS.
const SETTINGS: u8 = 4;

/// Watches the first bytes a client sends until the preface and a whole SETTINGS frame have
/// arrived, or the deadline passes.
struct Handshake {
    deadline: Pin<Box<tokio::time::Sleep>>,
    head: [u8; HEAD],
    seen: usize,
}

impl Handshake {
    /// Takes the next bytes read; true once the preface and the first SETTINGS frame are in.
    fn observe(&mut self, data: &[u8]) -> bool {
        if self.seen < HEAD {
            let n = data.len().min(HEAD - self.seen);
            self.head[self.seen..self.seen + n].copy_from_slice(&data[..n]);
        }
        self.seen += data.len();
        if self.seen < HEAD || self.head[..PREFACE.len()] != PREFACE[..] {
            // Not (yet) HTTP/2: the transport rejects a wrong preface by itself.
            return false;
        }
        let frame = &self.head[PREFACE.len()..];
        let len = u32::from_be_bytes([0, frame[0], frame[1], frame[2]]) as usize;
        frame[3] == SETTINGS && self.seen >= HEAD + len
    }
}

enum Stream {
    Plain(TcpStream),
    Accepting(Box<tokio_rustls::server::Accept<TcpStream>>),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Failed,
}

/// An accepted gRPC connection: TCP, or TLS completed lazily on first use, with the handshake
/// deadline enforced until the HTTP/2 preface and first SETTINGS frame have been read.
pub struct EdgeIo {
    stream: Stream,
    /// Bytes HTTP/2 wrote that are not on the socket yet ([`WRITE_COMBINE`]), from `wpos`.
    wbuf: Vec<u8>,
    wpos: usize,
    /// While set, a flush keeps what is held ([`FlushHold`]).
    hold: FlushHold,
    handshake: Option<Box<Handshake>>,
    timeouts: prometheus::IntCounter,
}

impl EdgeIo {
    /// Wraps an accepted socket; the deadline starts now. `timeouts` counts connections closed
    /// for missing it.
    pub fn new(
        sock: TcpStream,
        tls: Option<&Tls>,
        timeout: Duration,
        timeouts: prometheus::IntCounter,
    ) -> Self {
        let stream = match tls {
            Some(t) => Stream::Accepting(Box::new(t.0.accept(sock))),
            None => Stream::Plain(sock),
        };
        EdgeIo {
            stream,
            wbuf: Vec::new(),
            wpos: 0,
            hold: FlushHold::default(),
            handshake: Some(Box::new(Handshake {
                deadline: Box::pin(tokio::time::sleep(timeout)),
                head: [0; HEAD],
                seen: 0,
            })),
            timeouts,
        }
    }

    /// `Err(TimedOut)` once the deadline has passed while the handshake is still open; else
    /// registers the deadline with `cx` so a stalled peer is noticed.
    fn check_deadline(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let expired = match &mut self.handshake {
            Some(h) => h.deadline.as_mut().poll(cx).is_ready(),
            None => false,
        };
        if !expired {
            return Ok(());
        }
        self.stream = Stream::Failed;
        self.handshake = None;
        self.timeouts.inc();
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no HTTP/2 preface and SETTINGS within the handshake timeout",
        ))
    }

    /// Drives the TLS handshake, if one is pending.
    fn poll_established(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Stream::Accepting(accept) = &mut self.stream {
            match Pin::new(accept.as_mut()).poll(cx) {
                Poll::Ready(Ok(tls)) => self.stream = Stream::Tls(Box::new(tls)),
                Poll::Ready(Err(e)) => {
                    self.stream = Stream::Failed;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    self.check_deadline(cx)?;
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Runs one I/O operation on the established stream, enforcing the deadline while pending.
    fn poll_io<T>(
        &mut self,
        cx: &mut Context<'_>,
        op: impl FnOnce(Pin<&mut dyn AsyncIo>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        ready!(self.poll_established(cx))?;
        let stream: Pin<&mut dyn AsyncIo> = match &mut self.stream {
            Stream::Plain(s) => Pin::new(s as &mut dyn AsyncIo),
            Stream::Tls(s) => Pin::new(s.as_mut() as &mut dyn AsyncIo),
            Stream::Accepting(_) | Stream::Failed => {
                return Poll::Ready(Err(io::ErrorKind::NotConnected.into()))
            }
        };
        match op(stream, cx) {
            Poll::Pending => {
                self.check_deadline(cx)?;
                Poll::Pending
            }
            done => done,
        }
    }
}

/// Both halves of a byte stream.
trait AsyncIo: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> AsyncIo for T {}

impl AsyncRead for EdgeIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(this.poll_io(cx, |s, cx| s.poll_read(cx, buf)))?;
        if let Some(h) = &mut this.handshake {
            if h.observe(&buf.filled()[before..]) {
                this.handshake = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Most bytes [`EdgeIo`] holds between a write and the flush that sends them.
///
/// Why writes are combined: h2 writes a DATA frame of 1 KiB or more (its payload not copied) in
/// a write of its own after its buffer, and a connection's other frames (HEADERS, WINDOW_UPDATE,
/// a small DATA) wait for their next flush. Holding what h2 writes until it flushes — it flushes
/// after every round of frames, and when its 16 KiB buffer needs room, a flush the connection's
/// task holds back ([`FlushHold`]) — turns each round into one system call.
/// h2 is told the stream is not vectored (`is_write_vectored`), so it copies DATA below 1 KiB
/// into its 16 KiB buffer instead of writing each one alone: the streams sharing a connection
/// then share its writes (measured in docs/performance.md).
pub const WRITE_COMBINE: usize = 256 << 10;
/// Capacity of the combining buffer a connection keeps between writes.
const KEEP_WRITE_BUF: usize = 16 << 10;

impl EdgeIo {
    /// Writes what is held, until all of it is on the socket (or the socket is full).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.wpos < self.wbuf.len() {
            let (buf, pos) = (std::mem::take(&mut self.wbuf), self.wpos);
            let r = self.poll_io(cx, |s, cx| s.poll_write(cx, &buf[pos..]));
            self.wbuf = buf;
            match ready!(r)? {
                0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                n => self.wpos += n,
            }
        }
        self.wpos = 0;
        if self.wbuf.capacity() > KEEP_WRITE_BUF {
            // After a burst (a subscriber catching up): no 64 KiB kept per idle connection.
            self.wbuf = Vec::new();
        } else {
            self.wbuf.clear();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for EdgeIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.wbuf.len() + buf.len() > WRITE_COMBINE {
            ready!(this.poll_drain(cx))?;
        }
        if buf.len() >= WRITE_COMBINE {
            // Too large to hold: straight to the socket (nothing is held at this point).
            return this.poll_io(cx, |s, cx| s.poll_write(cx, buf));
        }
        this.wbuf.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Relaxed: set and read by the one task that drives this connection (`FlushHold`).
        if this.hold.0.load(Ordering::Relaxed) && this.wbuf.len() - this.wpos < WRITE_COMBINE {
            return Poll::Ready(Ok(()));
        }
        ready!(this.poll_drain(cx))?;
        this.poll_io(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if matches!(this.stream, Stream::Plain(_) | Stream::Tls(_)) {
            ready!(this.poll_drain(cx))?;
        }
        match &mut this.stream {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Accepting(_) | Stream::Failed => Poll::Ready(Ok(())),
        }
    }
}

/// Holds a connection's writes back across the flushes HTTP/2 asks for while its one task hands
/// it a round of frames (all the streams a record woke), and lets them go with the last flush
/// of the round: one system call per round however many streams the connection carries
/// (`crate::fanout`'s connection driver). Held bytes go out anyway once [`WRITE_COMBINE`] is
/// reached.
#[derive(Clone, Default)]
pub struct FlushHold(Arc<AtomicBool>);

impl FlushHold {
    /// Holds (`true`) or releases (`false`) the flushes that follow. Relaxed: the connection's
    /// task sets it and the same task's next flush (`EdgeIo::poll_flush`) reads it; the value
    /// hands over no data.
    pub fn hold(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }
}

impl EdgeIo {
    /// The handle that holds this connection's flushes ([`FlushHold`]).
    pub fn flush_hold(&self) -> FlushHold {
        self.hold.clone()
    }
}

/// Socket options for accepted gRPC connections: without `TCP_NODELAY`, small batches wait for
/// the peer's delayed ACK (milliseconds of latency); TCP keepalive reaps vanished peers.
pub fn tune(sock: &TcpStream) {
    if let Err(e) = sock.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
    }
    let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
    if let Err(e) = socket2::SockRef::from(sock).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "cannot set TCP keepalive");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handshake() -> Handshake {
        Handshake {
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
            head: [0; HEAD],
            seen: 0,
        }
    }

    #[tokio::test]
    async fn the_preface_and_a_whole_settings_frame_complete_the_handshake() {
        // SETTINGS with two 6-byte parameters.
        let mut bytes = PREFACE.to_vec();
        bytes.extend([0, 0, 12, SETTINGS, 0, 0, 0, 0, 0]);
        bytes.extend([0u8; 12]);
        for split in 0..bytes.len() {
            let mut h = handshake();
            let (a, b) = bytes.split_at(split);
            let (a_done, b_done) = (h.observe(a), h.observe(b));
            assert!(!a_done, "complete after only {split} bytes");
            assert!(b_done, "not complete after all {} bytes", bytes.len());
        }
        // Byte by byte.
        let mut h = handshake();
        let done: Vec<bool> = bytes.iter().map(|b| h.observe(&[*b])).collect();
        assert_eq!(done.iter().position(|d| *d), Some(bytes.len() - 1));
        // An empty SETTINGS frame is complete with its header.
        let mut h = handshake();
        let mut empty = PREFACE.to_vec();
        empty.extend([0, 0, 0, SETTINGS, 0, 0, 0, 0, 0]);
        assert!(h.observe(&empty));
    }

    #[tokio::test]
    async fn half_a_preface_or_another_protocol_never_completes() {
        let mut h = handshake();
        assert!(!h.observe(&PREFACE[..12]));
        let mut h = handshake();
        assert!(!h.observe(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789abcdef"));
        // The preface followed by a frame other than SETTINGS.
        let mut h = handshake();
        let mut bytes = PREFACE.to_vec();
        bytes.extend([0, 0, 0, 6, 0, 0, 0, 0, 0]);
        bytes.extend([0u8; 64]);
        assert!(!h.observe(&bytes));
    }

    #[test]
    fn accept_errors_are_classified() {
        let os = io::Error::from_raw_os_error;
        assert_eq!(
            AcceptErrorKind::of(&os(libc::EMFILE)),
            AcceptErrorKind::Emfile
        );
        assert_eq!(
            AcceptErrorKind::of(&os(libc::ENFILE)),
            AcceptErrorKind::Enfile
        );
        assert_eq!(
            AcceptErrorKind::of(&os(libc::ENOBUFS)),
            AcceptErrorKind::NoMemory
        );
        assert_eq!(
            AcceptErrorKind::of(&os(libc::ECONNABORTED)),
            AcceptErrorKind::Connection
        );
        assert_eq!(
            AcceptErrorKind::of(&os(libc::EBADF)),
            AcceptErrorKind::Other
        );
        assert!(AcceptErrorKind::Emfile.lasts() && !AcceptErrorKind::Connection.lasts());
    }

    /// Counts wake-ups.
    struct Wakes(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes are held until a flush, and across flushes while the connection's task holds them.
    #[tokio::test]
    async fn writes_are_held_until_a_flush_and_across_flushes_while_held() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (sock, _) = listener.accept().await.unwrap();
        let mut io = EdgeIo::new(
            sock,
            None,
            Duration::from_secs(3600),
            prometheus::IntCounter::new("t", "t").unwrap(),
        );
        let wakes = Arc::new(Wakes(Default::default()));
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut io = Pin::new(&mut io);
        async fn read(peer: &mut TcpStream, n: usize) -> Vec<u8> {
            let mut buf = vec![0u8; n];
            peer.read_exact(&mut buf).await.unwrap();
            buf
        }

        // One stream: held until the flush, then written.
        assert!(matches!(
            io.as_mut().poll_write(&mut cx, b"ab"),
            Poll::Ready(Ok(2))
        ));
        assert!(matches!(
            io.as_mut().poll_write(&mut cx, b"cd"),
            Poll::Ready(Ok(2))
        ));
        assert!(io.wbuf.len() == 4, "held, not written");
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        assert_eq!(read(&mut peer, 4).await, b"abcd");
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0);

        // Held: flushes keep the bytes until released (or the buffer is full).
        let hold = io.flush_hold();
        hold.hold(true);
        let _ = io.as_mut().poll_write(&mut cx, b"ef");
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        let _ = io.as_mut().poll_write(&mut cx, b"gh");
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        assert_eq!(io.wbuf.len(), 4, "held across flushes");
        let big = vec![7u8; WRITE_COMBINE];
        let _ = io.as_mut().poll_write(&mut cx, &big[..WRITE_COMBINE - 4]);
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        assert!(io.wbuf.is_empty(), "a full buffer is written while held");
        let mut want = b"efgh".to_vec();
        want.extend_from_slice(&big[..WRITE_COMBINE - 4]);
        assert_eq!(read(&mut peer, WRITE_COMBINE).await, want);
        let _ = io.as_mut().poll_write(&mut cx, b"ij");
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        hold.hold(false);
        assert!(io.as_mut().poll_flush(&mut cx).is_ready());
        assert!(io.wbuf.is_empty());
        assert_eq!(read(&mut peer, 2).await, b"ij");
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0, "nothing wakes the task");
    }
}
