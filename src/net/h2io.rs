//! The HTTP/2 plumbing the gRPC edge and both sides of the sidecar share, on the `h2` crate
//! directly:
//!
//! - the server set-up of kvbridge's gRPC port, one for both modes (`server_builder`, with its
//!   per-stream send buffer `SEND_BUFFER`);
//! - the accept-and-drain loop (`serve_connections`) and connection keepalive (`keepalive`);
//! - bodies: a received body as an [`http_body::Body`] (`RecvBody`), a body piped into a send
//!   stream with flow control (`Pipe`), tonic routes served on an `h2` stream (`serve_routes`);
//! - what a connection reads, watched (`Tap`, `OnRead`): the peer's SETTINGS as they arrive
//!   (`SettingsWatch`, `PeerSettings`);
//! - gRPC on HTTP/2 details: a status as trailers-only headers (`status_headers`), hop-by-hop
//!   headers removed from a forwarded message (`strip_hop_by_hop`).
//!
//! **Why `h2` and not hyper.** hyper's HTTP/2 server and client are thin layers over `h2`, but
//! each forwarded DATA frame crossed both of them (a body wrapper per side, a pipe task with its
//! own wrappers, ping bookkeeping). On a paced stream each message reaches a sleeping process
//! with cold caches, so what counts is how much code and state one message touches: serving on
//! `h2` directly, with the same three hand-offs per message (engine connection → stream →
//! client connection), cut the sidecar's CPU per paced message and the latency it adds
//! (`cargo bench --bench proxy`, README "Sidecar performance").

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};

/// Largest chunk [`RecvBody`] builds from DATA frames already received.
pub(crate) const COALESCE_MAX: usize = 64 * 1024;

/// What h2 may buffer per stream for sending (`max_send_buffer_size`), by default: bytes the
/// peer's windows allow but the socket has not taken. h2's own default is 400 KiB; a client
/// that advertises large windows and stops reading would make each of its streams hold that
/// much (about 40 MiB for a connection of 100 streams) until keepalive closed it. 128 KiB keeps
/// two of the fan-out's largest writes in flight per stream (`fanout` writes at most 64 KiB at
/// a time): the ring, not h2, is where records wait.
pub(crate) const SEND_BUFFER: usize = 128 << 10;

/// The one HTTP/2 server set-up of kvbridge's gRPC port (fan-out and sidecar): hyper's server
/// windows (1 MiB per stream and per connection; requests are small, the windows matter for
/// what clients send), header lists up to 16 KiB, and [`SEND_BUFFER`] per stream. A mode
/// tunes the returned builder for its own needs (the sidecar: its budget's windows and send
/// buffer, its stream limit).
pub(crate) fn server_builder() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(1 << 20)
        .initial_connection_window_size(1 << 20)
        .max_header_list_size(16 << 10)
        .max_send_buffer_size(SEND_BUFFER);
    b
}

/// A stream's received body: its DATA, in order, then its trailers. DATA frames that are already
/// waiting when one is read are joined into one chunk (up to [`COALESCE_MAX`]): gRPC messages
/// are a byte stream to HTTP/2 and frame boundaries carry no meaning, and a peer that writes one
/// small frame per message would otherwise cost a frame (and a wake-up) per message on the
/// other side of kvbridge too. Nothing waits for more data. Flow-control capacity is given back
/// as soon as bytes are read, as hyper does ([`RecvBody::new`]), or, for a body kvbridge
/// forwards, only once the other side has accepted them ([`RecvBody::forwarded`]): the stream's
/// window then bounds what kvbridge holds for it, not just what h2 buffers.
pub(crate) struct RecvBody {
    inner: h2::RecvStream,
    /// Give capacity back as bytes are read (else the [`Pipe`] they go into does).
    release_on_read: bool,
    /// An error met while joining frames, returned next.
    held: Option<h2::Error>,
    /// No more DATA: trailers (or the end) next.
    data_done: bool,
    /// Trailers (or the end) returned.
    done: bool,
}

impl RecvBody {
    pub(crate) fn new(inner: h2::RecvStream) -> Self {
        let done = inner.is_end_stream();
        RecvBody {
            inner,
            release_on_read: true,
            held: None,
            data_done: done,
            done,
        }
    }

    /// A body whose flow-control capacity the returned handle gives back, for a [`Pipe`] to
    /// release as it sends (see [`Pipe::releasing`]).
    pub(crate) fn forwarded(mut inner: h2::RecvStream) -> (Self, h2::FlowControl) {
        let flow = inner.flow_control().clone();
        let mut body = RecvBody::new(inner);
        body.release_on_read = false;
        (body, flow)
    }

    fn release(&mut self, n: usize) {
        if self.release_on_read {
            // Fails only when the stream is already gone; what is read is read either way.
            let _ = self.inner.flow_control().release_capacity(n);
        }
    }
}

impl HttpBody for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if let Some(e) = this.held.take() {
            this.done = true;
            return Poll::Ready(Some(Err(e)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        if !this.data_done {
            let first = match this.inner.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(d))) => d,
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.data_done = true;
                    Bytes::new()
                }
            };
            if !this.data_done {
                this.release(first.len());
                let mut joined: Option<BytesMut> = None;
                loop {
                    let len = joined.as_ref().map_or(first.len(), |j| j.len());
                    if len >= COALESCE_MAX {
                        break;
                    }
                    match this.inner.poll_data(cx) {
                        Poll::Ready(Some(Ok(d))) => {
                            this.release(d.len());
                            joined
                                .get_or_insert_with(|| {
                                    let mut b = BytesMut::with_capacity(COALESCE_MAX.min(len * 8));
                                    b.extend_from_slice(&first);
                                    b
                                })
                                .extend_from_slice(&d);
                        }
                        Poll::Ready(Some(Err(e))) => {
                            this.held = Some(e);
                            break;
                        }
                        Poll::Ready(None) => {
                            this.data_done = true;
                            break;
                        }
                        Poll::Pending => break,
                    }
                }
                let data = joined.map_or(first, BytesMut::freeze);
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
        }
        let trailers = ready!(this.inner.poll_trailers(cx));
        this.done = true;
        Poll::Ready(match trailers {
            Ok(Some(t)) => Some(Ok(Frame::trailers(t))),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && (self.done || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// How a [`Pipe`] ended early.
#[derive(Debug)]
pub(crate) enum PipeError {
    /// The receiving peer reset the stream (or the connection went away).
    Peer,
    /// The body failed; the stream was reset with `INTERNAL_ERROR` (or `CANCEL`).
    Body,
}

/// Sends `body` (DATA, then trailers) on an HTTP/2 stream, with backpressure: a chunk is sent
/// only as far as the stream has capacity (the receiver's window, and h2's send buffer), and the
/// next one is taken from the body only once the last is sent, so h2 buffers no more for a
/// stream than the receiver has room for. Capacity is claimed only for a chunk in hand, so a
/// body with nothing to send pins no connection window. With [`Pipe::releasing`], the bytes
/// sent are given back to the peer they came from as they go. A body that ends without
/// trailers ends the stream with an empty DATA frame. Resolves when the stream is complete, or
/// when the receiving peer resets it.
pub(crate) struct Pipe<B> {
    body: Pin<Box<B>>,
    send: h2::SendStream<Bytes>,
    /// A chunk waiting for stream capacity, and whether it ends the stream.
    held: Option<(Bytes, bool)>,
    /// Reset code for a failing body.
    on_error: h2::Reason,
    /// The source stream's flow control, given back what is sent.
    source: Option<h2::FlowControl>,
    /// DATA bytes sent so far.
    sent: u64,
}

impl<B> Pipe<B>
where
    B: HttpBody,
    B::Data: Buf,
{
    /// `on_error`: the reset a failing body sends (`CANCEL` when the body is a peer's request
    /// that peer abandoned, `INTERNAL_ERROR` for kvbridge's own).
    pub(crate) fn new(body: B, send: h2::SendStream<Bytes>, on_error: h2::Reason) -> Self {
        Pipe {
            body: Box::pin(body),
            send,
            held: None,
            on_error,
            source: None,
            sent: 0,
        }
    }

    /// Gives `source` back each byte as it is sent (for a body from
    /// [`RecvBody::forwarded`]): its sender may send more only as the receiver takes it.
    pub(crate) fn releasing(mut self, source: h2::FlowControl) -> Self {
        self.source = Some(source);
        self
    }
}

impl<B> Future for Pipe<B>
where
    B: HttpBody,
    B::Data: Buf,
{
    type Output = Result<(), PipeError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            if let Some((mut data, eos)) = this.held.take() {
                let capacity = loop {
                    match this.send.capacity() {
                        0 => {}
                        n => break n,
                    }
                    match this.send.poll_capacity(cx) {
                        Poll::Ready(Some(Ok(_))) => {}
                        Poll::Ready(Some(Err(_)) | None) => {
                            return Poll::Ready(Err(PipeError::Peer))
                        }
                        Poll::Pending => {
                            this.held = Some((data, eos));
                            return this.pending_unless_reset(cx);
                        }
                    }
                };
                if capacity < data.len() {
                    // As much as the receiver has room for; the rest waits for more.
                    let part = data.split_to(capacity);
                    this.send_chunk(part, false)?;
                    this.send.reserve_capacity(data.len());
                    this.held = Some((data, eos));
                    continue;
                }
                if this.send_chunk(data, eos)? {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let frame = match this.body.as_mut().poll_frame(cx) {
                Poll::Pending => return this.pending_unless_reset(cx),
                Poll::Ready(f) => f,
            };
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut d) => {
                        let eos = this.body.is_end_stream();
                        let data = d.copy_to_bytes(d.remaining());
                        if data.is_empty() {
                            if this.send_chunk(data, eos)? {
                                return Poll::Ready(Ok(()));
                            }
                            continue;
                        }
                        this.send.reserve_capacity(data.len());
                        this.held = Some((data, eos));
                    }
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            this.send.reserve_capacity(0);
                            this.send.send_trailers(t).map_err(|_| PipeError::Peer)?;
                            return Poll::Ready(Ok(()));
                        }
                    }
                },
                Some(Err(_)) => {
                    this.send.send_reset(this.on_error);
                    return Poll::Ready(Err(PipeError::Body));
                }
                None => {
                    this.send_chunk(Bytes::new(), true)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl<B> Pipe<B> {
    /// Sends one chunk (within the stream's capacity, or empty) and gives its bytes back to the
    /// source; `Ok(true)` when it ended the stream.
    fn send_chunk(&mut self, data: Bytes, eos: bool) -> Result<bool, PipeError> {
        let n = data.len();
        self.send
            .send_data(data, eos)
            .map_err(|_| PipeError::Peer)?;
        self.sent += n as u64;
        if let Some(source) = &mut self.source {
            // Fails only when the source stream is already gone.
            let _ = source.release_capacity(n);
        }
        Ok(eos)
    }

    /// DATA bytes sent so far: the receiver's progress.
    pub(crate) fn sent(&self) -> u64 {
        self.sent
    }

    /// Whether a chunk is waiting for the receiver to make room.
    pub(crate) fn is_waiting(&self) -> bool {
        self.held.is_some()
    }

    /// Resets the stream with `reason`.
    pub(crate) fn reset(&mut self, reason: h2::Reason) {
        self.send.send_reset(reason);
    }

    /// Pending, registered for the peer's reset too (so a client that goes away while nothing
    /// is sent is noticed and the call behind it cancelled).
    fn pending_unless_reset(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), PipeError>> {
        match self.send.poll_reset(cx) {
            Poll::Ready(_) => Poll::Ready(Err(PipeError::Peer)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Pings the peer every `interval` and resolves when a ping is not answered within `timeout`
/// (or the connection is gone): the caller then drops the connection. SMG's gateways ping every
/// 30 s themselves; kvbridge pings its peers too, so a silent peer's streams are reaped.
/// `None` (the ping handle was already taken) never resolves.
pub(crate) async fn keepalive(pp: Option<h2::PingPong>, interval: Duration, timeout: Duration) {
    let Some(mut pp) = pp else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(interval).await;
        match tokio::time::timeout(timeout, pp.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "HTTP/2 keepalive: connection gone");
                return;
            }
            Err(_) => {
                tracing::debug!(?timeout, "HTTP/2 keepalive: ping not answered");
                return;
            }
        }
    }
}

/// What kvbridge reads of a peer's first SETTINGS frame (RFC 9113 §6.5.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PeerSettings {
    /// `SETTINGS_MAX_HEADER_LIST_SIZE`; `None` when the peer did not send it (no limit).
    pub(crate) max_header_list_size: Option<u32>,
}

/// The first SETTINGS frame's parameter ids kvbridge reads.
const SETTINGS_MAX_HEADER_LIST_SIZE: u16 = 0x6;
/// Longest first SETTINGS frame accepted (the default `SETTINGS_MAX_FRAME_SIZE`).
const MAX_PREFACE_SETTINGS: usize = 16_384;

/// The first frame, as far as read.
#[derive(Default)]
struct Preface {
    head: [u8; 9],
    have: usize,
    payload: Vec<u8>,
}

impl Preface {
    /// Takes the next bytes the peer sent; the settings (or the error) once the first frame is
    /// complete.
    fn feed(&mut self, mut bytes: &[u8]) -> Option<Result<PeerSettings, String>> {
        while !bytes.is_empty() {
            if self.have < self.head.len() {
                let n = (self.head.len() - self.have).min(bytes.len());
                self.head[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                bytes = &bytes[n..];
                if self.have < self.head.len() {
                    return None;
                }
                let len = self.len();
                if self.head[3] != 0x4 {
                    return Some(Err(format!(
                        "its first frame is of type {}, not SETTINGS: not an HTTP/2 server",
                        self.head[3]
                    )));
                }
                if len % 6 != 0 || len > MAX_PREFACE_SETTINGS || self.head[4] & 1 != 0 {
                    return Some(Err(format!(
                        "its first SETTINGS frame is malformed ({len} bytes, flags {:#x})",
                        self.head[4]
                    )));
                }
                self.payload.reserve_exact(len);
            }
            let n = (self.len() - self.payload.len()).min(bytes.len());
            self.payload.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.payload.len() == self.len() {
                // Complete; what follows is the next frame's, not ours to read.
                break;
            }
        }
        (self.have == self.head.len() && self.payload.len() == self.len())
            .then(|| Ok(self.settings()))
    }

    fn len(&self) -> usize {
        u32::from_be_bytes([0, self.head[0], self.head[1], self.head[2]]) as usize
    }

    fn settings(&self) -> PeerSettings {
        let mut s = PeerSettings::default();
        for p in self.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([p[0], p[1]]);
            let value = u32::from_be_bytes([p[2], p[3], p[4], p[5]]);
            if id == SETTINGS_MAX_HEADER_LIST_SIZE {
                s.max_header_list_size = Some(value);
            }
        }
        s
    }
}

/// A connection's I/O with a look at every read: `hook` sees the bytes the peer sent (an empty
/// slice at end of stream) as they pass; writes go straight through.
pub(crate) struct Tap<T, H> {
    io: T,
    hook: H,
}

/// What a [`Tap`] does with what was read.
pub(crate) trait OnRead {
    fn on_read(&mut self, got: &[u8]);
}

impl<T, H> Tap<T, H> {
    pub(crate) fn new(io: T, hook: H) -> Self {
        Tap { io, hook }
    }
}

impl<T: tokio::io::AsyncRead + Unpin, H: OnRead + Unpin> tokio::io::AsyncRead for Tap<T, H> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        this.hook.on_read(&buf.filled()[before..]);
        Poll::Ready(Ok(()))
    }
}

impl<T: tokio::io::AsyncWrite + Unpin, H: Unpin> tokio::io::AsyncWrite for Tap<T, H> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Counts the bytes the peer sent into a shared counter, so that what kvbridge decodes from them
/// can be bounded against what actually arrived.
impl OnRead for std::sync::Arc<std::sync::atomic::AtomicU64> {
    fn on_read(&mut self, got: &[u8]) {
        self.fetch_add(got.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Watches the bytes the peer sends for its connection preface, the first frame, which must be
/// a SETTINGS frame (RFC 9113 §3.4), and reports it once (or why it is not one); after that a
/// read costs one branch. `h2`'s client handshake completes without the server's SETTINGS and
/// exposes neither their arrival nor the `SETTINGS_MAX_HEADER_LIST_SIZE` in them: this is how
/// the sidecar knows that the engine speaks HTTP/2 at all, and what header list it accepts.
pub(crate) struct SettingsWatch(Option<(Preface, SettingsTx)>);

type SettingsTx = tokio::sync::oneshot::Sender<Result<PeerSettings, String>>;

impl SettingsWatch {
    /// Reports the peer's first frame on `tx`.
    pub(crate) fn new(tx: SettingsTx) -> Self {
        SettingsWatch(Some((Preface::default(), tx)))
    }
}

impl OnRead for SettingsWatch {
    fn on_read(&mut self, got: &[u8]) {
        let Some((preface, _)) = &mut self.0 else {
            return;
        };
        let result = if got.is_empty() {
            Some(Err(
                "it closed the connection before its SETTINGS".to_string()
            ))
        } else {
            preface.feed(got)
        };
        if let Some(r) = result {
            if let Some((_, tx)) = self.0.take() {
                let _ = tx.send(r);
            }
        }
    }
}

/// Serves one call with tonic `routes`: kvbridge's own services other than `SubscribeKvEvents`
/// (health, reflection, and `UNIMPLEMENTED` for the engine services' other methods when there is
/// no engine behind kvbridge); `SubscribeKvEvents` never reaches here, the connection loop serves
/// it. The client's stream is the request body; the route's response is piped back with flow
/// control.
pub(crate) async fn serve_routes(
    routes: tonic::service::Routes,
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    use tower::ServiceExt;
    let req = req.map(|b| tonic::body::Body::new(RecvBody::new(b)));
    let resp = match routes.oneshot(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    };
    let (parts, body) = resp.into_parts();
    let end = body.is_end_stream();
    let Ok(send) = respond.send_response(http::Response::from_parts(parts, ()), end) else {
        return;
    };
    if !end {
        let _ = Pipe::new(body, send, h2::Reason::INTERNAL_ERROR).await;
    }
}

/// Serves the connections `incoming` yields, each on a task of its own (`connection(io,
/// stopping)`), until `shutdown`. Then the listener closes (a new connection is refused at once
/// rather than left in the backlog), `stopping` turns true for every open connection (it sends
/// GOAWAY and ends when its last stream does), and this returns once they all have ended.
pub(crate) async fn serve_connections<IO, C>(
    incoming: impl futures_util::Stream<Item = IO> + Send,
    shutdown: impl Future<Output = ()> + Send,
    mut connection: impl FnMut(IO, tokio::sync::watch::Receiver<bool>) -> C + Send,
) where
    C: Future<Output = ()> + Send + 'static,
{
    use futures_util::StreamExt;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    // Boxed, so that dropping it below closes the listener (a pinned local would live on).
    let mut incoming = Box::pin(incoming);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let io = tokio::select! {
            _ = &mut shutdown => break,
            io = incoming.next() => match io {
                Some(io) => io,
                None => break,
            },
            // Reap finished connections as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        connections.spawn(connection(io, stopping.clone()));
    }
    drop(incoming);
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

/// The headers of a trailers-only response (`grpc-status`, `grpc-message`, ...) for `status`.
pub(crate) fn status_headers(status: &tonic::Status) -> http::Response<()> {
    let (parts, _) = status.clone().into_http::<tonic::body::Body>().into_parts();
    http::Response::from_parts(parts, ())
}

/// Headers a forwarded message must not carry across kvbridge (hop-by-hop, RFC 9110 §7.6.1).
/// HTTP/2 forbids most of them anyway (h2 refuses to send them); `te: trailers`, which gRPC
/// requires, is the one kept.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers and `host` (HTTP/2 carries it as `:authority`).
pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    for name in HOP_BY_HOP {
        h.remove(name);
    }
    h.remove(http::header::HOST);
    if h.get(http::header::TE)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"trailers"))
    {
        h.remove(http::header::TE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    #[test]
    fn the_first_settings_frame_is_read_across_reads_and_the_rest_ignored() {
        // SETTINGS: MAX_CONCURRENT_STREAMS 100, MAX_HEADER_LIST_SIZE 16384; then a
        // WINDOW_UPDATE in the same read.
        let mut wire = vec![0, 0, 12, 4, 0, 0, 0, 0, 0];
        wire.extend_from_slice(&[0, 3, 0, 0, 0, 100, 0, 6, 0, 0, 0x40, 0]);
        wire.extend_from_slice(&[0, 0, 4, 8, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        for split in [1, 5, 9, 14, 21, wire.len()] {
            let mut p = Preface::default();
            let first = p.feed(&wire[..split]);
            let r = first.or_else(|| p.feed(&wire[split..]));
            assert_eq!(
                r,
                Some(Ok(PeerSettings {
                    max_header_list_size: Some(16384)
                })),
                "split at {split}"
            );
        }
        let mut p = Preface::default();
        assert!(matches!(
            p.feed(b"HTTP/1.1 400 Bad Request\r\n"),
            Some(Err(_))
        ));
        let mut p = Preface::default();
        assert_eq!(
            p.feed(&[0, 0, 0, 4, 0, 0, 0, 0, 0]),
            Some(Ok(PeerSettings::default()))
        );
    }

    #[test]
    fn hop_by_hop_headers_go_and_grpc_metadata_stays() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "close"),
            ("keep-alive", "5"),
            ("te", "trailers"),
            ("grpc-timeout", "5S"),
            ("authorization", "Bearer x"),
            ("x-custom-bin", "AAEC"),
            ("host", "kvbridge"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
        names.sort();
        assert_eq!(
            names,
            ["authorization", "grpc-timeout", "te", "x-custom-bin"]
        );
        let mut h = HeaderMap::new();
        h.insert(http::header::TE, HeaderValue::from_static("gzip"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "te other than trailers is hop-by-hop");
    }
}
