//! One forwarded call, opaquely, at the HTTP/2 level (docs/smg-api.md §2 "Proxy mode").
//!
//! | what | how |
//! |---|---|
//! | path, metadata | the request's `:path` and headers go upstream as they are; only hop-by-hop headers (RFC 9110 §7.6.1) are dropped, and `:scheme` / `:authority` become the engine's |
//! | messages | the request and response bodies are the client's and engine's own HTTP/2 DATA frames, passed on as `Bytes` without looking inside: no protobuf decode, no re-framing |
//! | response headers | returned the moment the engine sends them, before any message (SMG gives a stream 2 s to answer headers) |
//! | trailers | the engine's trailers frame unchanged (`grpc-status`, `grpc-message`, `grpc-status-details-bin`, custom) |
//! | deadline | `grpc-timeout` is metadata like any other: the engine enforces it and answers with its own status |
//! | cancellation | a client that resets before the engine's answer drops the upstream response and request bodies, which resets the engine's stream; a client already gone when its call would open sends nothing; a burst of such resets on one engine connection moves later calls to a fresh one (`upstream::RESET_BURST`); an engine that resets ends the client's call with the status its reset means |
//! | failure | no connection: `UNAVAILABLE` naming the engine, as a trailers-only response |
//! | buffering | the call goes to the engine once it has a share of the buffer budgets (`budget.rs`); each side is given flow-control capacity back only as the other accepts the bytes; a call that moves no byte it owes (a response its client does not take, a request unfinished) for `--sidecar-stall-timeout-ms` while other streams wait for a share is ended `RESOURCE_EXHAUSTED` |

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::{Code, Status};

use super::budget::{ConnectionBudget, Share};
use super::upstream::{Connection, EngineState, Upstream};
use super::ProxyMetrics;
use crate::net::h2io::{status_headers, strip_hop_by_hop, Pipe, RecvBody};

/// Forwards the client's call `req` to the engine and answers it on `respond`: the engine's
/// headers, every DATA frame, its trailers; or `UNAVAILABLE` when the engine cannot be reached.
/// Returns when the call is over on both sides (a client that resets ends it at once: dropping
/// the engine side resets the engine's stream).
pub(crate) async fn forward(
    upstream: &Upstream,
    metrics: &Arc<ProxyMetrics>,
    budget: &ConnectionBudget,
    req: Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    let started = Instant::now();
    let method = super::method_label(req.uri().path());
    let (mut parts, body) = req.into_parts();
    if let Err(status) = to_engine(upstream, &mut parts) {
        return finish_early(metrics, method, respond, status);
    }
    let down = match engine_down(upstream.state()) {
        Ok(down) => down,
        Err(status) => return finish_early(metrics, method, respond, status),
    };
    let mut down = std::pin::pin!(down);
    let end = body.is_end_stream();
    let opened = open_call(upstream, budget, &parts, end, &mut respond, down.as_mut()).await;
    let (share, response, up_send, lease) = match opened {
        Ok(opened) => opened,
        Err(Early::Cancelled) => return CallRecord::count(metrics, method, "cancelled"),
        Err(Early::Answer(status)) => return finish_early(metrics, method, respond, status),
    };
    // Until the engine answers, leaving resets the engine's stream: counted on its connection.
    let unanswered = Unanswered(Some((lease, upstream.address())));
    metrics.overhead.observe(started.elapsed().as_secs_f64());
    let mut flow = Flow {
        stall: budget.stall.map(Stall::new),
        response,
        // The client's messages go up while the engine has not answered yet (client
        // streaming: it answers after the last one).
        request: (!end).then(|| {
            let (body, flow) = RecvBody::forwarded(body);
            Pipe::new(body, up_send, h2::Reason::CANCEL).releasing(flow)
        }),
        unanswered,
        share,
    };
    let resp = match engine_headers(upstream, &mut respond, down.as_mut(), &mut flow).await {
        Ok(resp) => resp,
        Err(Early::Cancelled) => return CallRecord::count(metrics, method, "cancelled"),
        Err(Early::Answer(status)) => return finish_early(metrics, method, respond, status),
    };
    metrics
        .headers_latency
        .observe(started.elapsed().as_secs_f64());
    relay(upstream, metrics, method, resp, &mut respond, flow).await;
}

/// Points the client's request at the engine: its `:path` on the engine's base URI, without
/// hop-by-hop headers.
fn to_engine(upstream: &Upstream, parts: &mut http::request::Parts) -> Result<(), Status> {
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = format!("{}{path}", upstream.base)
        .parse()
        .map_err(|e| Status::internal(format!("bad path: {e}")))?;
    strip_hop_by_hop(&mut parts.headers);
    Ok(())
}

/// While the probe finds the engine down, calls fail at once with its reason (`Err`); else
/// the future that ends with that status once the probe finds it down, so a call waiting for
/// the engine fails then (a stopped engine never answers: without this the wait would last
/// until the connection's keepalive).
fn engine_down(
    mut state: tokio::sync::watch::Receiver<EngineState>,
) -> Result<impl Future<Output = Status>, Status> {
    if let EngineState::Down(why) = &*state.borrow_and_update() {
        return Err(Status::unavailable(why.to_string()));
    }
    Ok(async move {
        let why = state
            .wait_for(|s| matches!(s, EngineState::Down(_)))
            .await
            .ok()
            .and_then(|s| match &*s {
                EngineState::Down(why) => Some(why.to_string()),
                _ => None,
            });
        match why {
            Some(why) => Status::unavailable(why),
            // The sidecar is going away.
            None => std::future::pending().await,
        }
    })
}

/// How a call ends before the engine's response headers reach its client.
enum Early {
    /// The client went away: counted as cancelled, nothing sent.
    Cancelled,
    /// Answered with this status alone (trailers-only).
    Answer(Status),
}

/// A call's stream to the engine, opened: its share of the buffer budgets, the engine's
/// response to come, the request's send side, and the connection it went to.
type Opened = (
    Share,
    h2::client::ResponseFuture,
    h2::SendStream<Bytes>,
    Connection,
);

/// Waits for the call's share of the buffer budgets, then opens its stream to the engine;
/// unless the client goes away first or the probe finds the engine down.
async fn open_call(
    upstream: &Upstream,
    budget: &ConnectionBudget,
    parts: &http::request::Parts,
    end: bool,
    respond: &mut h2::server::SendResponse<Bytes>,
    down: Pin<&mut impl Future<Output = Status>>,
) -> Result<Opened, Early> {
    let open = async {
        // Nothing goes to the engine before the stream has its share of the buffer budgets.
        let share = budget.share().await;
        open_stream(upstream, parts, end)
            .await
            .map(|(response, up_send, lease)| (share, response, up_send, lease))
    };
    tokio::select! {
        biased;
        // The client went away before (a connection kvbridge closed with its streams already
        // accepted: nothing of them goes to the engine) or while the call waited (for a share,
        // or a connection).
        _ = poll_fn(|cx| respond.poll_reset(cx)) => Err(Early::Cancelled),
        r = open => r.map_err(Early::Answer),
        status = down => Err(Early::Answer(status)),
    }
}

/// What a call holds once its stream to the engine is open. The fields drop in declaration
/// order, as the locals they were did: the stall timer, the engine's response, the request,
/// the unanswered mark, last the share.
struct Flow<'a> {
    stall: Option<Stall>,
    response: h2::client::ResponseFuture,
    /// The client's request body going up, until it is done.
    request: Option<Pipe<RecvBody>>,
    unanswered: Unanswered<'a>,
    share: Share,
}

/// Waits for the engine's response headers while the client's messages go up; ends the call
/// early if it stalls, the client goes away, or the probe finds the engine down.
async fn engine_headers(
    upstream: &Upstream,
    respond: &mut h2::server::SendResponse<Bytes>,
    mut down: Pin<&mut impl Future<Output = Status>>,
    flow: &mut Flow<'_>,
) -> Result<Response<h2::RecvStream>, Early> {
    poll_fn(|cx| {
        poll_request(&mut flow.request, cx);
        if let Some(stall) = &mut flow.stall {
            let (sent, waiting) = progress(&flow.request, None::<&Pipe<Relay>>);
            if stall.poll_stalled(cx, sent, waiting, &flow.share) {
                return Poll::Ready(Err(Early::Answer(stall.status(&flow.share))));
            }
        }
        if respond.poll_reset(cx).is_ready() {
            // The client went away before the engine answered.
            return Poll::Ready(Err(Early::Cancelled));
        }
        if let Poll::Ready(status) = down.as_mut().poll(cx) {
            return Poll::Ready(Err(Early::Answer(status)));
        }
        let r = ready!(Pin::new(&mut flow.response).poll(cx));
        // Answered (or failed on the engine's side): nothing left to reset.
        flow.unanswered.0 = None;
        Poll::Ready(r.map_err(|e| Early::Answer(upstream_error(upstream.address(), &e))))
    })
    .await
}

/// Answers the client with the engine's response `resp`: its headers at once, then every DATA
/// frame and its trailers, while the client's messages keep going up. Returns when the call is
/// over (or has stalled: then the client's stream is reset).
async fn relay(
    upstream: &Upstream,
    metrics: &Arc<ProxyMetrics>,
    method: &'static str,
    resp: Response<h2::RecvStream>,
    respond: &mut h2::server::SendResponse<Bytes>,
    mut flow: Flow<'_>,
) {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // A trailers-only answer carries its status in the headers.
    let status = grpc_status(&parts.headers);
    let call = CallRecord {
        metrics: metrics.clone(),
        method,
        status,
    };
    let (body, released) = RecvBody::forwarded(body);
    let body = Relay {
        inner: body,
        call: Some(call),
        engine: upstream.address().to_string(),
        failed: false,
    };
    let end = body.is_end_stream();
    let send = match respond.send_response(Response::from_parts(parts, ()), end) {
        Ok(s) => s,
        // The client is gone; `body` drops, resetting the engine's stream.
        Err(_) => return,
    };
    if end {
        return;
    }
    let mut pipe = Pipe::new(body, send, h2::Reason::INTERNAL_ERROR).releasing(released);
    poll_fn(|cx| {
        poll_request(&mut flow.request, cx);
        if let Some(stall) = &mut flow.stall {
            let (sent, waiting) = progress(&flow.request, Some(&pipe));
            if stall.poll_stalled(cx, sent, waiting, &flow.share) {
                // Trailers would wait behind the unsent data: a reset reaches the client now.
                let _ = stall.status(&flow.share);
                pipe.reset(h2::Reason::ENHANCE_YOUR_CALM);
                return Poll::Ready(Ok(()));
            }
        }
        Pin::new(&mut pipe).poll(cx)
    })
    .await
    .ok();
    // Back goes the share first; then (`flow`'s other fields drop after `pipe`) a client still
    // sending after the engine's answer: the call is over, its stream reset.
    drop(flow.share);
}

/// Bytes sent so far in both directions of a call, and whether it is owed bytes that do not
/// move: a request still unfinished, or a response chunk its client has no room for. (A call
/// whose request is complete and whose engine is still working owes nothing.)
fn progress<A, B>(request: &Option<Pipe<A>>, response: Option<&Pipe<B>>) -> (u64, bool) {
    let a = request.as_ref().map_or(0, |p| p.sent());
    let (b, wb) = response.map_or((0, false), |p| (p.sent(), p.is_waiting()));
    (a + b, request.is_some() || wb)
}

/// Watches a call for peers that move nothing: stalled once neither direction has moved a byte
/// for `after` while it is owed bytes ([`progress`]) and another stream waits for a share (so a
/// slow peer keeps its stream as long as nobody needs the space).
struct Stall {
    after: std::time::Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// The call's progress when the timer was set.
    seen: u64,
}

impl Stall {
    fn new(after: std::time::Duration) -> Self {
        Stall {
            after,
            timer: Box::pin(tokio::time::sleep(after)),
            seen: 0,
        }
    }

    /// True once the call is stalled (`sent`: its progress so far; `waiting`: a chunk waits
    /// for its receiver); else registers for the next check.
    fn poll_stalled(
        &mut self,
        cx: &mut Context<'_>,
        sent: u64,
        waiting: bool,
        share: &Share,
    ) -> bool {
        while self.timer.as_mut().poll(cx).is_ready() {
            if sent == self.seen && waiting && share.contended() {
                return true;
            }
            self.seen = sent;
            let next = tokio::time::Instant::now() + self.after;
            self.timer.as_mut().reset(next);
        }
        false
    }

    /// Counts and logs a stalled call's end; the status its client gets.
    fn status(&self, share: &Share) -> Status {
        share.count_stall_reset();
        let why = format!(
            "kvbridge sidecar: nothing of this call moved for {:?} while other calls waited for buffer space (--sidecar-stall-timeout-ms)",
            self.after
        );
        tracing::debug!("{why}");
        Status::resource_exhausted(why)
    }
}

/// Moves the client's request body on, dropping the pipe once it is done (or failed: the
/// response side then sees what happened).
fn poll_request<B>(request: &mut Option<Pipe<B>>, cx: &mut Context<'_>)
where
    B: HttpBody,
    B::Data: bytes::Buf,
{
    if let Some(p) = request {
        if Pin::new(p).poll(cx).is_ready() {
            *request = None;
        }
    }
}

/// The `grpc-status` a headers or trailers frame carries, if any.
fn grpc_status(h: &HeaderMap) -> Option<i32> {
    h.get("grpc-status")
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|s| s.parse().ok())
}

/// Counts the engine's stream on its connection as reset unanswered when dropped armed
/// ([`Connection::reset_unanswered`]); disarmed once the engine answers.
struct Unanswered<'a>(Option<(Connection, &'a str)>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some((lease, engine)) = self.0.take() {
            lease.reset_unanswered(engine);
        }
    }
}

/// Opens the call's stream to the engine (and returns the connection it went to): a pool
/// connection that cannot open one (the engine sent GOAWAY: it shuts down gracefully, or judged
/// another client's burst of reset streams abuse, "too_many_resets") leaves its slot, and the
/// call tries the next, at most once per slot and once more: nothing of it has reached the
/// engine yet.
async fn open_stream(
    upstream: &Upstream,
    parts: &http::request::Parts,
    end: bool,
) -> Result<
    (
        h2::client::ResponseFuture,
        h2::SendStream<Bytes>,
        Connection,
    ),
    Status,
> {
    let mut attempts = 0;
    loop {
        let lease = upstream.sender().await?;
        let opened = match lease.sender.clone().ready().await {
            Ok(mut sender) => sender.send_request(head(parts), end),
            Err(e) => Err(e),
        };
        match opened {
            Ok((response, send)) => return Ok((response, send, lease)),
            Err(e) => {
                lease.retire();
                attempts += 1;
                if attempts > super::upstream::POOL_SIZE {
                    return Err(upstream_error(upstream.address(), &e));
                }
            }
        }
    }
}

/// The request's head again (a request sent on a connection that refused it is gone).
fn head(parts: &http::request::Parts) -> Request<()> {
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req
}

/// Answers `respond` with `status` alone (trailers-only), counted under `method`.
fn finish_early(
    metrics: &ProxyMetrics,
    method: &str,
    mut respond: h2::server::SendResponse<Bytes>,
    status: Status,
) {
    CallRecord::count(metrics, method, super::code_name(status.code()));
    let _ = respond.send_response(status_headers(&status), true);
}

/// The status a failed upstream exchange means for the client: a reset stream keeps its
/// meaning (the mapping gRPC clients apply to RST_STREAM, gRPC's HTTP/2 spec), anything else is
/// the engine being unreachable.
fn upstream_error(engine: &str, e: &h2::Error) -> Status {
    match e.reason() {
        Some(r) if e.is_reset() => status_of_reset(r, engine),
        _ => Status::unavailable(format!(
            "kvbridge sidecar: engine gRPC server {engine}: {e}"
        )),
    }
}

fn status_of_reset(r: h2::Reason, engine: &str) -> Status {
    let code = match r {
        h2::Reason::REFUSED_STREAM => Code::Unavailable,
        h2::Reason::CANCEL => Code::Cancelled,
        h2::Reason::ENHANCE_YOUR_CALM => Code::ResourceExhausted,
        h2::Reason::INADEQUATE_SECURITY => Code::PermissionDenied,
        _ => Code::Internal,
    };
    Status::new(
        code,
        format!("engine gRPC server {engine} reset the stream: {r}"),
    )
}

/// Counts a call once, when it ends (or is dropped: the client went away).
struct CallRecord {
    metrics: Arc<ProxyMetrics>,
    method: &'static str,
    status: Option<i32>,
}

impl CallRecord {
    fn count(metrics: &ProxyMetrics, method: &str, code: &str) {
        metrics.calls.with_label_values(&[method, code]).inc();
    }

    fn label(&self) -> &'static str {
        match self.status {
            Some(c) => super::code_name(Code::from_i32(c)),
            None => "cancelled",
        }
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        Self::count(&self.metrics, self.method, self.label());
    }
}

/// The engine's response body as the client gets it: the engine's DATA and trailers unchanged;
/// an upstream error after the headers becomes a trailers frame with the status it means, so
/// the client's call ends with a gRPC status rather than a bare reset. Records the call's
/// status for the metrics.
struct Relay {
    inner: RecvBody,
    call: Option<CallRecord>,
    engine: String,
    failed: bool,
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        let item = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        Poll::Ready(match item {
            Some(Ok(frame)) => {
                if let Some(t) = frame.trailers_ref() {
                    if let Some(call) = &mut this.call {
                        call.status = grpc_status(t).or(Some(Code::Unknown as i32));
                    }
                }
                Some(Ok(frame))
            }
            Some(Err(e)) => {
                let status = upstream_error(&this.engine, &e);
                if let Some(call) = &mut this.call {
                    call.status = Some(status.code() as i32);
                }
                this.failed = true;
                let mut trailers = HeaderMap::new();
                trailers.insert(
                    HeaderName::from_static("grpc-status"),
                    HeaderValue::from(status.code() as i32),
                );
                if let Ok(v) = HeaderValue::from_str(&percent_encode(status.message())) {
                    trailers.insert(HeaderName::from_static("grpc-message"), v);
                }
                Some(Ok(Frame::trailers(trailers)))
            }
            None => {
                if let Some(call) = &mut this.call {
                    if call.status.is_none() {
                        // Ended without trailers or a status in the headers.
                        call.status = Some(Code::Unknown as i32);
                    }
                }
                None
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// gRPC's `grpc-message` encoding: printable ASCII except `%` as is, the rest percent-encoded.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resets_keep_their_meaning() {
        assert_eq!(
            status_of_reset(h2::Reason::CANCEL, "e").code(),
            Code::Cancelled
        );
        assert_eq!(
            status_of_reset(h2::Reason::REFUSED_STREAM, "e").code(),
            Code::Unavailable
        );
        assert_eq!(
            status_of_reset(h2::Reason::INTERNAL_ERROR, "e").code(),
            Code::Internal
        );
        assert_eq!(percent_encode("a b%\n"), "a b%25%0A");
    }
}
