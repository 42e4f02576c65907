//! One forwarded call, opaquely, at the HTTP/2 level (docs/smg-api.md §2 "Proxy mode").
//!
//! | what | how |
//! |---|---|
//! | path, metadata | the request's `:path` and headers go upstream as they are; only hop-by-hop headers (RFC 9110 §7.6.1) are dropped, and `:scheme` / `:authority` become the engine's |
//! | messages | the request and response bodies are the client's and engine's own HTTP/2 DATA frames, passed on as `Bytes` without looking inside: no protobuf decode, no re-framing |
//! | response headers | returned the moment the engine sends them, before any message (SMG gives a stream 2 s to answer headers) |
//! | trailers | the engine's trailers frame unchanged (`grpc-status`, `grpc-message`, `grpc-status-details-bin`, custom) |
//! | deadline | `grpc-timeout` is metadata like any other: the engine enforces it and answers with its own status |
//! | cancellation | a client that resets drops the upstream response and request bodies, which resets the engine's stream; an engine that resets ends the client's call with the status its reset means |
//! | failure | no connection: `UNAVAILABLE` naming the engine, as a trailers-only response |

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use tonic::body::Body;
use tonic::{Code, Status};

use super::upstream::Upstream;
use crate::metrics::Metrics;

/// Hop-by-hop headers: they describe one connection, never the call (RFC 9110 §7.6.1). HTTP/2
/// forbids most of them anyway; `te: trailers`, which gRPC requires, is the one kept.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
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

/// Forwards `req` to the engine; the response (headers, every DATA frame, trailers) is the
/// engine's, or `UNAVAILABLE` when the engine cannot be reached.
pub(crate) async fn forward(
    upstream: &Upstream,
    metrics: &Arc<Metrics>,
    req: Request<Incoming>,
) -> Response<Body> {
    let started = Instant::now();
    let method = super::method_label(req.uri().path());
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = match format!("{}{path}", upstream.base).parse() {
        Ok(u) => u,
        Err(e) => {
            return finish_early(metrics, &method, Status::internal(format!("bad path: {e}")))
        }
    };
    strip_hop_by_hop(&mut parts.headers);
    let mut sender = match upstream.sender().await {
        Ok(s) => s,
        Err(s) => return finish_early(metrics, &method, s),
    };
    if let Err(e) = sender.ready().await {
        return finish_early(metrics, &method, upstream_error(upstream, &e));
    }
    let call = sender.send_request(Request::from_parts(parts, Body::new(body)));
    metrics
        .proxy
        .overhead
        .observe(started.elapsed().as_secs_f64());
    let resp = match call.await {
        Ok(r) => r,
        Err(e) => return finish_early(metrics, &method, upstream_error(upstream, &e)),
    };
    metrics
        .proxy
        .headers_latency
        .observe(started.elapsed().as_secs_f64());
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // A trailers-only answer carries its status in the headers.
    let status = parts
        .headers
        .get("grpc-status")
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|s| s.parse::<i32>().ok());
    let body = Relay {
        inner: body,
        call: Some(CallRecord {
            metrics: metrics.clone(),
            method,
            status,
        }),
        engine: upstream.address().to_string(),
        failed: false,
        held: None,
        ended: false,
    };
    Response::from_parts(parts, Body::new(body))
}

/// A trailers-only response with `status`, counted under `method`.
fn finish_early(metrics: &Metrics, method: &str, status: Status) -> Response<Body> {
    metrics
        .proxy
        .calls
        .with_label_values(&[method, super::code_name(status.code())])
        .inc();
    status.into_http()
}

/// The status a failed upstream exchange means for the client: a reset stream keeps its
/// meaning (the mapping gRPC clients apply to RST_STREAM, gRPC's HTTP/2 spec), anything else is
/// the engine being unreachable.
fn upstream_error(upstream: &Upstream, e: &hyper::Error) -> Status {
    let reason = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<h2::Error>())
        .and_then(|h| h.reason());
    match reason {
        Some(r) => status_of_reset(r, upstream.address()),
        None => Status::unavailable(format!(
            "kvbridge sidecar: engine gRPC server {}: {e}",
            upstream.address()
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
    metrics: Arc<Metrics>,
    method: String,
    status: Option<i32>,
}

impl CallRecord {
    fn label(&self) -> &'static str {
        match self.status {
            Some(c) => super::code_name(Code::from_i32(c)),
            None => "cancelled",
        }
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        self.metrics
            .proxy
            .calls
            .with_label_values(&[&self.method, self.label()])
            .inc();
    }
}

/// Largest chunk [`Relay`] builds from DATA frames the engine has already delivered.
const COALESCE_MAX: usize = 64 * 1024;

/// The engine's response body: its bytes, in order, and its trailers. DATA frames that are
/// already waiting when one is read are joined into one chunk (up to [`COALESCE_MAX`]): gRPC
/// messages are a byte stream to HTTP/2, frame boundaries carry no meaning, and an engine that
/// writes one small frame per `Generate` message would otherwise cost a frame (and a wake-up) per
/// message on both sides of kvbridge. Nothing waits for more data: what is not there yet is not
/// waited for. An upstream error after the headers becomes a trailers frame with the status it
/// means, so the client's call ends with a gRPC status rather than a bare reset.
struct Relay {
    inner: Incoming,
    call: Option<CallRecord>,
    engine: String,
    failed: bool,
    /// A frame (trailers) or error read while coalescing, returned next.
    held: Option<Result<Frame<Bytes>, hyper::Error>>,
    /// The engine's body ended while coalescing.
    ended: bool,
}

impl Relay {
    /// Bookkeeping for what the engine's body yielded: the status of trailers, an error turned
    /// into trailers, the end.
    fn on_frame(
        &mut self,
        item: Option<Result<Frame<Bytes>, hyper::Error>>,
    ) -> Option<Result<Frame<Bytes>, hyper::Error>> {
        match item {
            Some(Ok(frame)) => {
                if let Some(t) = frame.trailers_ref() {
                    let code = t
                        .get("grpc-status")
                        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
                        .and_then(|s| s.parse::<i32>().ok());
                    if let Some(call) = &mut self.call {
                        call.status = code.or(Some(Code::Unknown as i32));
                    }
                }
                Some(Ok(frame))
            }
            Some(Err(e)) => {
                let reason = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<h2::Error>())
                    .and_then(|h| h.reason());
                let status = match reason {
                    Some(r) => status_of_reset(r, &self.engine),
                    None => Status::unavailable(format!(
                        "kvbridge sidecar: engine gRPC server {}: {e}",
                        self.engine
                    )),
                };
                if let Some(call) = &mut self.call {
                    call.status = Some(status.code() as i32);
                }
                self.failed = true;
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
                if let Some(call) = &mut self.call {
                    if call.status.is_none() {
                        // Ended without trailers or a status in the headers.
                        call.status = Some(Code::Unknown as i32);
                    }
                }
                None
            }
        }
    }
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(held) = this.held.take() {
            return Poll::Ready(this.on_frame(Some(held)));
        }
        if this.failed || this.ended {
            return Poll::Ready(this.on_frame(None));
        }
        let first = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(f))) if f.is_data() => f.into_data().unwrap_or_default(),
            Poll::Ready(other) => return Poll::Ready(this.on_frame(other)),
        };
        if first.len() >= COALESCE_MAX {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        let mut joined: Option<BytesMut> = None;
        loop {
            let len = joined.as_ref().map_or(first.len(), |j| j.len());
            if len >= COALESCE_MAX {
                break;
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) if f.is_data() => {
                    let d = f.into_data().unwrap_or_default();
                    joined
                        .get_or_insert_with(|| {
                            let mut b = BytesMut::with_capacity(COALESCE_MAX.min(len * 8));
                            b.extend_from_slice(&first);
                            b
                        })
                        .extend_from_slice(&d);
                }
                Poll::Ready(Some(other)) => {
                    this.held = Some(other);
                    break;
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    break;
                }
                Poll::Pending => break,
            }
        }
        let data = joined.map_or(first, BytesMut::freeze);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && (self.failed || self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
