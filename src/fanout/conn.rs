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
//! **Everything else** on the connection — health, reflection, an unknown path — is served by the
//! edge's tonic routes on a task of its own, as in sidecar mode (`crate::net::h2io`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use http_body::Body as _;
use tonic::Status;

use super::body::RecordsBody;
use super::call::{stream_headers, PathHandler};
use crate::net::h2io::{self, RecvBody};
use crate::net::{EdgeIo, FlushHold};

/// What the edge's connections share: the four `SubscribeKvEvents` handlers and the routes
/// for every other path.
pub(super) struct Paths {
    pub(super) subscribe: Vec<PathHandler>,
    pub(super) routes: tonic::service::Routes,
}

impl Paths {
    fn subscribe(&self, path: &str) -> Option<&PathHandler> {
        self.subscribe.iter().find(|h| h.path() == path)
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

/// Trailers carrying `status`.
fn status_trailers(status: &Status) -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    if status.add_header(&mut trailers).is_err() {
        trailers.insert(Status::GRPC_STATUS, (status.code() as i32).into());
    }
    trailers
}

/// Serves one accepted connection until the client closes it, stops answering keepalive pings,
/// or (after `stopping`) its last stream ends.
pub(super) async fn serve(
    paths: Arc<Paths>,
    builder: h2::server::Builder,
    io: EdgeIo,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let hold = io.flush_hold();
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
    let mut driver = Driver {
        conn,
        hold,
        paths,
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
struct Driver {
    conn: h2::server::Connection<EdgeIo, Bytes>,
    hold: FlushHold,
    paths: Arc<Paths>,
    keepalive: Pin<Box<dyn Future<Output = ()> + Send>>,
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
    stopping: bool,
    opening: FuturesUnordered<Opening>,
    live: Vec<Live>,
}

impl Driver {
    /// One round: new requests, opened streams, every stream's records, then one write.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.stopping && self.stop.as_mut().poll(cx).is_ready() {
            self.stopping = true;
            self.conn.graceful_shutdown();
        }
        if self.keepalive.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
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
            loop {
                match self.conn.poll_accept(cx) {
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
            match self.conn.poll_accept(cx) {
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

    /// A new request: a `SubscribeKvEvents` stream is opened here; any other call is served by
    /// the routes on a task of its own.
    fn accept(
        &mut self,
        req: http::Request<h2::RecvStream>,
        respond: h2::server::SendResponse<Bytes>,
    ) {
        let Some(handler) = self.paths.subscribe(req.uri().path()).cloned() else {
            tokio::spawn(h2io::serve_routes(self.paths.routes.clone(), req, respond));
            return;
        };
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
