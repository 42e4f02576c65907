//! One `SubscribeKvEvents` call: the request read and checked (the bearer token, the one
//! length-prefixed request message), the subscription opened, and the response it gets — the
//! stream's headers and its body of framed records ([`RecordsBody`]), or the status it ends
//! with at once. The edge's connections (`conn.rs`) serve calls through [`PathHandler`], in
//! sidecar mode too.
//!
//! The call is served by hand rather than by tonic's generated servers, because the response
//! is already on the wire format: every record is one framed gRPC message, and the body
//! (`body.rs`) writes it as it is. The request side is the generated message type, decoded from
//! the one length-prefixed message a server-streaming call carries.

use std::sync::Arc;

use bytes::Buf;
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
async fn read_request<B>(body: B) -> Result<SubscribeKvEventsRequest, Status>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
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

/// The response headers of a stream that opened: gRPC, and the id of the ring its sequence
/// numbers belong to (the same id after a kvbridge restart on its ring, a continuation;
/// another after a ring reset: docs/subscribers.md).
pub(super) fn stream_headers(ring_id: http::HeaderValue) -> http::HeaderMap {
    let mut headers = http::HeaderMap::with_capacity(2);
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert(super::RING_ID_HEADER, ring_id);
    headers
}

impl PathHandler {
    /// The handler of `path`: calls check the token `secrets` hold, then subscribe to `fanout`.
    pub(super) fn new(
        fanout: Arc<Fanout>,
        path: &'static str,
        secrets: Arc<crate::secrets::Secrets>,
    ) -> Self {
        PathHandler {
            fanout,
            path,
            secrets,
        }
    }

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

    /// The path this handler serves.
    pub(super) fn path(&self) -> &'static str {
        self.path
    }

    /// One call, from its request headers and body: the request read and checked, the
    /// subscription opened. Its response headers ([`stream_headers`] of the ring id) and body,
    /// or the status the call ends with at once.
    pub(super) async fn call<B>(
        self,
        headers: http::HeaderMap,
        body: B,
    ) -> Result<(http::HeaderValue, RecordsBody), Status>
    where
        B: http_body::Body,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let md = tonic::metadata::MetadataMap::from_headers(headers);
        self.check_auth(&md)?;
        let msg = read_request(body)
            .await
            .map_err(|s| self.fanout.status(s))?;
        let (records, ring_id) = self.open(&md, msg).await?;
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
        Ok((ring_id, RecordsBody::new(records, self.fanout.linger, acct)))
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
}
