//! One gRPC connection of the edge, served on `h2` directly by one task: the connection itself
//! and every `SubscribeKvEvents` stream it carries.
//!
//! **Why one task.** Served by hyper, each stream is a task of its own: a record committed to the
//! ring wakes every stream task, each hands its DATA to the connection task, and the connection
//! writes between stream rounds — several writes per record on a connection with many streams,
//! two task hand-offs per stream and record. Here the record wakes the connection's task once;
//! it polls every stream it carries, queues each one's DATA, and the connection writes them all
//! in one system call (`crate::net::FlushHold` keeps h2's intermediate flushes, made when its
//! 16 KiB buffer fills, off the socket until the round is done).
//!
//! **Flow control.** A stream takes records from the ring only when HTTP/2 has send capacity
//! for it: it asks for one byte (its intent to send, which takes nothing from the other streams
//! of the connection), and h2 asks the windows for the rest as the records are queued. A stream
//! whose records wait for the client's window takes no more: they stay in the ring (its cursor is
//! the buffer) until a WINDOW_UPDATE wakes the task, and a subscriber that falls a ring behind
//! gets `DATA_LOSS` as anywhere else.
//!
//! **Everything else** on the connection is the server's to serve ([`Others`]), each call on a
//! task of its own: the edge's tonic routes (health, reflection, an unknown path), and in sidecar
//! mode (`crate::proxy`) the calls forwarded to the engine.
//!
//! # Contracts
//!
//! - **Who wakes whom.** The task's own waker is registered by the stream bodies (the ring's
//!   futex wake-up, a linger timer), by the streams' `poll_capacity` / `poll_reset` and by the
//!   opening calls. The h2 connection is polled with [`ConnWake`] instead: h2 wakes it for every
//!   frame a stream queues, and those wakes are already served by the connection's poll later in
//!   the same round, so a wake while the task polls only marks the round for a rerun, and one
//!   between polls wakes the task.
//! - **One round** ([`Driver::round`]): open what was accepted, poll every stream (each queues
//!   DATA as far as its send capacity allows), then poll the connection, which accepts new
//!   requests and flushes. A rerun ([`rounds`]) repeats this while a wake came during it, at most
//!   [`MAX_RERUNS`] times; then the task wakes itself and yields to the runtime.
//! - **One write per round** relies on an h2 internal: every `Connection::poll_accept` ends in a
//!   `poll_flush` of what the streams queued. [`FlushHold`] keeps the flushes h2 makes mid-round
//!   (when its 16 KiB write buffer fills) off the socket, so the round's frames leave together.
//! - **What h2 buffers.** Per stream at most `crate::net::h2io::SEND_BUFFER` (128 KiB) beyond
//!   what the socket took, plus the write in progress (a body yields at most 64 KiB at a time);
//!   a stream is given capacity only while it is under that, so the rest waits in the ring.
//! - **Two body pipes.** The streams here are polled in place (`Live`), in this task; a call the
//!   server hands elsewhere (tonic's routes, a forwarded call) runs on a task of its own and pipes
//!   its body with `h2io::Pipe`. One pipe would put every subscription on a task of its own again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use http_body::Body as _;
use tonic::Status;

use super::body::{status_trailers, RecordsBody};
use super::call::{stream_headers, PathHandler};
use crate::net::h2io::{self, RecvBody};
use crate::net::FlushHold;

/// The four `SubscribeKvEvents` handlers every connection of the edge serves streams with.
pub struct Streams {
    pub(super) subscribe: Vec<PathHandler>,
}

impl Streams {
    fn subscribe(&self, path: &str) -> Option<&PathHandler> {
        self.subscribe.iter().find(|h| h.path() == path)
    }
}

/// A call as it arrives on a connection.
pub type Call = http::Request<h2::RecvStream>;
/// [`Others::admit`].
pub type Admit = dyn FnMut(&Call) -> Result<(), Status> + Send;
/// [`Others::serve`].
pub type ServeOther = dyn Fn(Call, h2::server::SendResponse<Bytes>) + Send + Sync;

/// What a connection does with the calls that are not `SubscribeKvEvents` streams, and which
/// calls it takes at all.
pub struct Others {
    /// Checks each call's headers before it is served; an error refuses the call with that
    /// status and closes the connection (`ENHANCE_YOUR_CALM`).
    pub admit: Box<Admit>,
    /// Serves a call that is not a `SubscribeKvEvents` stream, on a task of its own.
    pub serve: Box<ServeOther>,
}

impl Others {
    /// Every call admitted, and served by tonic `routes`.
    pub fn routes(routes: tonic::service::Routes) -> Self {
        Others {
            admit: Box::new(|_| Ok(())),
            serve: Box::new(move |req, respond| {
                tokio::spawn(h2io::serve_routes(routes.clone(), req, respond));
            }),
        }
    }
}

/// A stream being opened: its request read and checked, the subscription opened.
type Opening = Pin<
    Box<
        dyn Future<
                Output = (
                    h2::server::SendResponse<Bytes>,
                    Result<(http::HeaderValue, RecordsBody), Status>,
                ),
            > + Send,
    >,
>;

/// One open `SubscribeKvEvents` stream: its records, and where they go.
struct Live {
    body: RecordsBody,
    send: h2::SendStream<Bytes>,
}

impl Live {
    /// Hands HTTP/2 what the stream has to send, as far as flow control lets it; ready when the
    /// stream is over (ended with its status, or reset by the client).
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.send.poll_reset(cx).is_ready() {
                // The client cancelled (or the connection is going): the subscription ends here.
                return Poll::Ready(());
            }
            if self.send.capacity() == 0 {
                // Assigned at once when the windows have room (no round trip to the connection).
                self.send.reserve_capacity(1);
                if self.send.capacity() == 0 {
                    match self.send.poll_capacity(cx) {
                        Poll::Ready(Some(Ok(_))) => continue,
                        Poll::Ready(Some(Err(_)) | None) => return Poll::Ready(()),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if self.send.send_data(data, false).is_err() {
                            return Poll::Ready(());
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            let _ = self.send.send_trailers(trailers);
                        }
                        return Poll::Ready(());
                    }
                },
                Poll::Ready(Some(Err(status))) => {
                    let _ = self.send.send_trailers(status_trailers(&status));
                    return Poll::Ready(());
                }
                Poll::Ready(None) => {
                    let _ = self.send.send_data(Bytes::new(), true);
                    return Poll::Ready(());
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Serves one accepted connection until the client closes it, stops answering keepalive pings,
/// or (after `stopping`) its last stream ends: `SubscribeKvEvents` streams in this task, the
/// other calls as `others` says. `hold` is `io`'s ([`crate::net::EdgeIo::flush_hold`]).
pub async fn serve<IO>(
    streams: Arc<Streams>,
    builder: h2::server::Builder,
    io: IO,
    hold: FlushHold,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    others: Others,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = match builder.handshake::<_, Bytes>(io).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = %e, "gRPC connection ended in its handshake");
            return;
        }
    };
    let keepalive = Box::pin(h2io::keepalive(
        conn.ping_pong(),
        super::CLIENT_KEEPALIVE_INTERVAL,
        super::CLIENT_KEEPALIVE_TIMEOUT,
    ));
    let wake = Arc::new(ConnWake::default());
    let mut driver = Driver {
        conn,
        conn_waker: std::task::Waker::from(wake.clone()),
        wake,
        hold,
        streams,
        others,
        keepalive,
        stop: Box::pin(async move {
            let _ = stopping.wait_for(|s| *s).await;
        }),
        stopping: false,
        opening: FuturesUnordered::new(),
        live: Vec::new(),
    };
    std::future::poll_fn(|cx| driver.poll(cx)).await;
}

/// The connection and its streams (see the module docs).
struct Driver<IO> {
    conn: h2::server::Connection<IO, Bytes>,
    /// The waker the connection is polled with ([`ConnWake`]).
    wake: Arc<ConnWake>,
    conn_waker: std::task::Waker,
    hold: FlushHold,
    streams: Arc<Streams>,
    others: Others,
    keepalive: Pin<Box<dyn Future<Output = ()> + Send>>,
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
    stopping: bool,
    opening: FuturesUnordered<Opening>,
    live: Vec<Live>,
}

/// The waker h2 holds for the connection. h2 wakes its connection's task for the first frame a
/// stream queues after each poll of the connection, and here the streams' frames are queued by
/// the connection's own task, in the round that polls the connection next: a wake-up of the task
/// per round for nothing. A wake that comes while the task is polling only marks the round for
/// a rerun (if it came after the connection's poll); one that comes between polls wakes the task.
#[derive(Default)]
struct ConnWake(parking_lot::Mutex<ConnWakeState>);

#[derive(Default)]
struct ConnWakeState {
    /// The task's own waker, as of its last poll.
    task: Option<std::task::Waker>,
    /// The task is polling.
    polling: bool,
    /// Woken while polling.
    woken: bool,
}

impl ConnWake {
    /// A poll of the task starts.
    fn start(&self, task: &std::task::Waker) {
        let mut s = self.0.lock();
        s.polling = true;
        s.woken = false;
        if !s.task.as_ref().is_some_and(|t| t.will_wake(task)) {
            s.task = Some(task.clone());
        }
    }

    /// The connection is polled next: what woke it so far is served by that poll.
    fn covered(&self) {
        self.0.lock().woken = false;
    }

    /// The poll ends; true if a wake came meanwhile (poll again). One lock with `wake_by_ref`:
    /// a wake either sees `polling` and is returned here, or sees it cleared and wakes the task.
    fn finish(&self) -> bool {
        let mut s = self.0.lock();
        s.polling = false;
        std::mem::take(&mut s.woken)
    }
}

impl std::task::Wake for ConnWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let task = {
            let mut s = self.0.lock();
            s.woken = true;
            if s.polling {
                None
            } else {
                s.task.clone()
            }
        };
        if let Some(t) = task {
            t.wake();
        }
    }
}

/// The HTTP status refusing a request that is not a gRPC call, as gRPC's HTTP/2 protocol asks:
/// `405` for a method other than `POST`, `415` for a content type that does not begin with
/// `application/grpc` (so that no HTTP client takes a gRPC error, sent with `200`, for success).
fn not_grpc<B>(req: &http::Request<B>) -> Option<http::StatusCode> {
    if req.method() != http::Method::POST {
        return Some(http::StatusCode::METHOD_NOT_ALLOWED);
    }
    let grpc = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    (!grpc).then_some(http::StatusCode::UNSUPPORTED_MEDIA_TYPE)
}

/// Rounds one poll of the connection's task may run before it yields to the runtime.
const MAX_RERUNS: usize = 32;

/// Runs `round` again while a wake came during it ([`ConnWake`]), at most [`MAX_RERUNS`] times;
/// then wakes the task and yields, so that the runtime polls it again after its other tasks. A
/// round woken every time is not a live connection's: tokio-rustls wakes itself in one abnormal
/// state and relies on tokio's task budget to stop that loop, which a poll that never returns
/// would defeat (in sidecar mode this task's thread is the sidecar's only one).
fn rounds(
    wake: &ConnWake,
    cx: &mut Context<'_>,
    mut round: impl FnMut(&mut Context<'_>) -> Poll<()>,
) -> Poll<()> {
    for _ in 0..MAX_RERUNS {
        wake.start(cx.waker());
        if round(cx).is_ready() {
            return Poll::Ready(());
        }
        if !wake.finish() {
            return Poll::Pending;
        }
    }
    cx.waker().wake_by_ref();
    Poll::Pending
}

impl<IO> Driver<IO>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    /// Polls until the connection and every stream wait; a wake that came in meanwhile
    /// ([`ConnWake`]) means another round now rather than another poll of the task, up to
    /// [`MAX_RERUNS`] ([`rounds`]).
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let wake = self.wake.clone();
        rounds(&wake, cx, |cx| self.round(cx))
    }

    /// One round: new requests, opened streams, every stream's records, then one write.
    fn round(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.stopping && self.stop.as_mut().poll(cx).is_ready() {
            self.stopping = true;
            self.conn.graceful_shutdown();
        }
        if self.keepalive.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let conn_waker = self.conn_waker.clone();
        let mut conn_cx = Context::from_waker(&conn_waker);
        loop {
            // What h2 flushes while the round hands it frames stays in the buffer. (With one
            // stream h2's own flush at the end of the round is the only one: nothing to hold.)
            let hold = self.live.len() + self.opening.len() > 1;
            self.hold.hold(hold);
            let mut again = false;
            while let Poll::Ready(Some((respond, opened))) = self.opening.poll_next_unpin(cx) {
                self.opened(respond, opened);
            }
            self.live.retain_mut(|s| s.poll(cx).is_pending());
            // The wakes the streams' frames gave the connection are served by this poll.
            self.wake.covered();
            loop {
                match self.conn.poll_accept(&mut conn_cx) {
                    Poll::Ready(Some(Ok((req, respond)))) => {
                        self.accept(req, respond);
                        again = true;
                    }
                    Poll::Ready(Some(Err(e))) => return self.ended(Some(e)),
                    Poll::Ready(None) => return self.ended(None),
                    Poll::Pending => break,
                }
            }
            if again {
                continue;
            }
            if !hold {
                return Poll::Pending;
            }
            // The round is done: the connection's flush writes it all.
            self.hold.hold(false);
            match self.conn.poll_accept(&mut conn_cx) {
                Poll::Ready(Some(Ok((req, respond)))) => self.accept(req, respond),
                Poll::Ready(Some(Err(e))) => return self.ended(Some(e)),
                Poll::Ready(None) => return self.ended(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn ended(&mut self, e: Option<h2::Error>) -> Poll<()> {
        self.hold.hold(false);
        if let Some(e) = e {
            tracing::debug!(error = %e, "gRPC connection ended");
        }
        Poll::Ready(())
    }

    /// A new request: refused (and the connection closed) if not admitted; a `SubscribeKvEvents`
    /// stream is opened here; any other call is the server's ([`Others`]).
    fn accept(
        &mut self,
        req: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
    ) {
        if let Err(status) = (self.others.admit)(&req) {
            tracing::warn!(error = %status.message(), "closing a gRPC connection: ENHANCE_YOUR_CALM");
            let _ = respond.send_response(h2io::status_headers(&status), true);
            self.conn.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
            return;
        }
        let Some(handler) = self.streams.subscribe(req.uri().path()).cloned() else {
            (self.others.serve)(req, respond);
            return;
        };
        if let Some(refused) = not_grpc(&req) {
            let mut response = http::Response::new(());
            *response.status_mut() = refused;
            let _ = respond.send_response(response, true);
            return;
        }
        let (parts, body) = req.into_parts();
        self.opening.push(Box::pin(async move {
            let opened = handler.call(parts.headers, RecvBody::new(body)).await;
            (respond, opened)
        }));
    }

    /// A stream opened (its response headers go out, and it joins the live ones), or ended at
    /// once with a status (a trailers-only response).
    fn opened(
        &mut self,
        mut respond: h2::server::SendResponse<Bytes>,
        opened: Result<(http::HeaderValue, RecordsBody), Status>,
    ) {
        match opened {
            Ok((ring_id, body)) => {
                let mut response = http::Response::new(());
                *response.headers_mut() = stream_headers(ring_id);
                if let Ok(send) = respond.send_response(response, false) {
                    self.live.push(Live { body, send });
                }
            }
            Err(status) => {
                let _ = respond.send_response(h2io::status_headers(&status), true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts wake-ups.
    struct Wakes(AtomicUsize);
    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A wake while the task polls reruns the round instead of waking the task; one after the
    /// poll wakes it; one before the connection's poll is served by that poll.
    #[test]
    fn a_wake_during_the_poll_is_a_rerun_and_after_it_a_wake_up() {
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        let task = std::task::Waker::from(wakes.clone());
        let wake = Arc::new(ConnWake::default());
        let conn = std::task::Waker::from(wake.clone());

        wake.start(&task);
        conn.wake_by_ref();
        assert!(wake.finish(), "woken while polling: poll again");
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0);

        wake.start(&task);
        conn.wake_by_ref();
        wake.covered();
        assert!(!wake.finish(), "served by the connection's poll");

        conn.wake_by_ref();
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            1,
            "between polls the task is woken"
        );
        wake.start(&task);
        assert!(!wake.finish(), "that wake started this poll");
    }

    /// A round that is woken every time (an IO that wakes itself) runs `MAX_RERUNS` times, then
    /// the task yields, woken to be polled again after the runtime's other tasks.
    #[test]
    fn a_round_woken_every_time_yields_after_the_cap() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
            let task = std::task::Waker::from(wakes.clone());
            let mut cx = Context::from_waker(&task);
            let wake = Arc::new(ConnWake::default());
            let conn = std::task::Waker::from(wake.clone());
            let mut runs = 0;
            let out = rounds(&wake, &mut cx, |_| {
                runs += 1;
                conn.wake_by_ref();
                Poll::Pending
            });
            let _ = tx.send((out, runs, wakes.0.load(Ordering::Relaxed)));
        });
        let (out, runs, task_wakes) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the poll returned (no cap: it never does)");
        assert_eq!(out, Poll::Pending);
        assert_eq!(runs, MAX_RERUNS);
        assert_eq!(task_wakes, 1, "the task is woken to be polled again");
    }
}
