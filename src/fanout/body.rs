//! The HTTP/2 response body of one `SubscribeKvEvents` stream: framed records out, as they are,
//! and `grpc-status` in the trailers at the end.
//!
//! Why not tonic's server-streaming encoder: it copies every message into a `BytesMut` of its
//! own, per subscriber. Here each record already is one framed gRPC message, shared by every
//! subscriber ([`super::EncodedBatch`]): a record that goes out alone is handed to HTTP/2 as that
//! same buffer.
//!
//! Bounded batching (`--fanout-linger`): when the subscriber's next record is not there yet, the
//! records already taken wait at most the linger for more, then go out as one DATA frame (one
//! copy into one buffer, one write). While it lingers the stream is not woken by each record
//! committed, only by its timer: a write costs one wake-up however many records it carries. With a linger of 0 nothing waits; records that are already
//! there (a subscriber catching up) still go out together. Either way a write holds at most
//! [`MAX_WRITE`] bytes, so a long catch-up is a run of bounded writes, each one only after
//! HTTP/2 flow control asked for more.
//!
//! Metrics are counted per write, not per record: the counters move once, and the clock is read
//! once for every record that goes out in that write.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use http_body::Frame;
use tonic::Status;

use super::{code_label, FanoutMetrics, Outgoing};

/// Most bytes one write gathers (a record larger than this goes out alone).
pub(super) const MAX_WRITE: usize = 64 << 10;

/// What a stream sends: records, then one ending status.
pub(super) type Records = Pin<Box<dyn Stream<Item = Result<Outgoing, Status>> + Send + 'static>>;

/// The metric handles a stream updates, resolved once when it opens.
pub(super) struct Accounting {
    pub(super) metrics: std::sync::Arc<FanoutMetrics>,
    /// `send_latency` of this stream's path.
    pub(super) latency: prometheus::Histogram,
    /// `catchup_sends` of this stream's path.
    pub(super) catchup: prometheus::IntCounter,
    /// When the stream opened (Unix ns): records ingested before are catch-up, not live.
    pub(super) opened_ns: u64,
}

impl Accounting {
    /// One write of `held` (already ordered): counts, bytes, lag, and for live records the time
    /// from ingest to this hand-off (one clock read).
    fn written(&self, held: &[Outgoing], bytes: usize) {
        let m = &self.metrics;
        m.batches_sent.inc_by(held.len() as u64);
        m.bytes_sent.inc_by(bytes as u64);
        let mut now = 0;
        let mut catchup = 0;
        for o in held {
            if o.ingest_ns >= self.opened_ns {
                if now == 0 {
                    now = crate::clock::unix_nanos();
                }
                self.latency
                    .observe(now.saturating_sub(o.ingest_ns) as f64 * 1e-9);
            } else if o.ingest_ns > 0 {
                catchup += 1;
            }
        }
        if catchup > 0 {
            self.catchup.inc_by(catchup);
        }
        if let Some(last) = held.iter().rev().find(|o| o.ingest_ns > 0) {
            m.subscriber_lag.observe(last.lag as f64);
        }
    }

    /// The stream ends with `s`.
    fn ended(&self, s: &Status) {
        let m = &self.metrics;
        m.statuses.with_label_values(&[code_label(s.code())]).inc();
        if s.code() == tonic::Code::DataLoss {
            m.resumes.with_label_values(&["data_loss"]).inc();
        }
    }
}

/// Trailers carrying `status` (`grpc-status`, `grpc-message`, ...).
pub(super) fn status_trailers(status: &Status) -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    // A message that cannot be a header value still leaves the code.
    if status.add_header(&mut trailers).is_err() {
        trailers.insert(Status::GRPC_STATUS, (status.code() as i32).into());
    }
    trailers
}

/// The body: see the module docs.
pub(super) struct RecordsBody {
    records: Records,
    linger: Duration,
    /// Armed when the first held record was taken and more could follow.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    held: Vec<Outgoing>,
    held_bytes: usize,
    /// The ending status, once the records ended (sent after what is held).
    end: Option<Status>,
    done: bool,
    acct: Accounting,
}

impl RecordsBody {
    pub(super) fn new(records: Records, linger: Duration, acct: Accounting) -> Self {
        RecordsBody {
            records,
            linger,
            timer: None,
            held: Vec::new(),
            held_bytes: 0,
            end: None,
            done: false,
            acct,
        }
    }

    /// The held records as one buffer: the shared one when a record goes alone.
    fn take_held(&mut self) -> Bytes {
        self.acct.written(&self.held, self.held_bytes);
        let out = if self.held.len() == 1 {
            self.held[0].batch.wire().clone()
        } else {
            let mut buf = BytesMut::with_capacity(self.held_bytes);
            for o in &self.held {
                buf.extend_from_slice(o.batch.wire());
            }
            buf.freeze()
        };
        self.held.clear();
        self.held_bytes = 0;
        self.timer = None;
        out
    }

    /// Whether the held records go out now, without waiting for more.
    fn due(&mut self, cx: &mut Context<'_>) -> bool {
        if self.held_bytes >= MAX_WRITE || self.linger.is_zero() {
            return true;
        }
        let linger = self.linger;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(linger)));
        timer.as_mut().poll(cx).is_ready()
    }
}

impl http_body::Body for RecordsBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        // Lingering: only the timer wakes this stream until it runs out, not every record
        // committed meanwhile; they are all taken when it does. (A record wakes the stream at
        // most once per linger: the one wait registered by the poll that started it.)
        let mut expired = false;
        if let Some(timer) = &mut this.timer {
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            expired = true;
        }
        while this.end.is_none() && this.held_bytes < MAX_WRITE {
            match this.records.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(o))) => {
                    this.held_bytes += o.batch.wire().len();
                    this.held.push(o);
                }
                Poll::Ready(Some(Err(s))) => this.end = Some(s),
                Poll::Ready(None) => this.end = Some(Status::ok("")),
                Poll::Pending => break,
            }
        }
        if !this.held.is_empty() {
            if expired || this.end.is_some() || this.due(cx) {
                return Poll::Ready(Some(Ok(Frame::data(this.take_held()))));
            }
            return Poll::Pending;
        }
        match this.end.take() {
            Some(s) => {
                this.done = true;
                if s.code() != tonic::Code::Ok {
                    this.acct.ended(&s);
                }
                Poll::Ready(Some(Ok(Frame::trailers(status_trailers(&s)))))
            }
            None => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fanout::EncodedBatch;
    use http_body::Body as _;
    use http_body_util::BodyExt;

    fn acct() -> Accounting {
        let m = crate::metrics::Metrics::new();
        let metrics = std::sync::Arc::new(FanoutMetrics::new(&m));
        Accounting {
            latency: metrics.send_latency.with_label_values(&["/t"]),
            catchup: metrics.catchup_sends.with_label_values(&["/t"]),
            opened_ns: 0,
            metrics,
        }
    }

    fn rec(i: u8) -> Outgoing {
        Outgoing::made(EncodedBatch::frame(&[i; 3]))
    }

    /// A body over what is sent on `tx`.
    fn body(
        linger: Duration,
    ) -> (
        tokio::sync::mpsc::UnboundedSender<Result<Outgoing, Status>>,
        RecordsBody,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let records = Box::pin(tokio_stream_of(rx));
        (tx, RecordsBody::new(records, linger, acct()))
    }

    fn tokio_stream_of(
        mut rx: tokio::sync::mpsc::UnboundedReceiver<Result<Outgoing, Status>>,
    ) -> impl Stream<Item = Result<Outgoing, Status>> + Send {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    /// The framed messages of one DATA frame, as their first payload byte.
    fn messages(mut data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while !data.is_empty() {
            let len = u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize;
            out.push(data[5]);
            data = &data[5 + len..];
        }
        out
    }

    async fn next_data(b: &mut RecordsBody) -> Vec<u8> {
        let f = b.frame().await.expect("a frame").expect("not an error");
        messages(&f.into_data().expect("a DATA frame"))
    }

    /// Records that are there already go out in one write, linger or not.
    #[tokio::test]
    async fn ready_records_go_out_together() {
        let (tx, mut b) = body(Duration::ZERO);
        for i in 1..=3 {
            tx.send(Ok(rec(i))).unwrap();
        }
        assert_eq!(next_data(&mut b).await, [1, 2, 3]);
        tx.send(Ok(rec(4))).unwrap();
        assert_eq!(next_data(&mut b).await, [4]);
    }

    /// With a linger, a record waits for the next one that comes within it.
    #[tokio::test(start_paused = true)]
    async fn a_record_waits_for_more_within_the_linger() {
        let (tx, mut b) = body(Duration::from_millis(5));
        tx.send(Ok(rec(1))).unwrap();
        let t0 = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            tx.send(Ok(rec(2))).unwrap();
            tx
        });
        assert_eq!(next_data(&mut b).await, [1, 2]);
        // Written when the linger ran out, not when the second record came.
        assert_eq!(t0.elapsed(), Duration::from_millis(5));
        let tx = sender.await.unwrap();
        // Idle: the next record waits for nothing longer than the linger.
        tx.send(Ok(rec(3))).unwrap();
        let t1 = tokio::time::Instant::now();
        assert_eq!(next_data(&mut b).await, [3]);
        assert_eq!(t1.elapsed(), Duration::from_millis(5));
    }

    /// An ending status goes out after what is held, at once, as the trailers.
    #[tokio::test(start_paused = true)]
    async fn the_status_follows_the_held_records_without_waiting() {
        let (tx, mut b) = body(Duration::from_secs(1));
        tx.send(Ok(rec(1))).unwrap();
        tx.send(Err(Status::data_loss("fell behind"))).unwrap();
        let t0 = tokio::time::Instant::now();
        assert_eq!(next_data(&mut b).await, [1]);
        let f = b.frame().await.unwrap().unwrap();
        let trailers = f.into_trailers().expect("trailers");
        assert_eq!(trailers["grpc-status"], "15");
        assert_eq!(trailers["grpc-message"], "fell%20behind"); // percent-encoded, as gRPC says
        assert_eq!(t0.elapsed(), Duration::ZERO, "waited");
        assert!(b.frame().await.is_none());
        assert!(b.is_end_stream());
    }

    /// A write holds at most MAX_WRITE bytes (plus the record that crossed it).
    #[tokio::test]
    async fn a_long_catch_up_is_bounded_writes() {
        let (tx, mut b) = body(Duration::ZERO);
        let big = vec![7u8; 10 << 10];
        for _ in 0..20 {
            tx.send(Ok(Outgoing::made(EncodedBatch::frame(&big))))
                .unwrap();
        }
        let mut sizes = Vec::new();
        let mut n = 0;
        while n < 20 {
            let f = b.frame().await.unwrap().unwrap().into_data().unwrap();
            n += messages(&f).len();
            sizes.push(f.len());
        }
        assert!(sizes.len() >= 3, "{sizes:?}");
        assert!(
            sizes.iter().all(|&s| s < MAX_WRITE + (10 << 10) + 5),
            "{sizes:?}"
        );
    }
}
