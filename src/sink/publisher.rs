//! One ring's publisher: resume point from the stream, then a bounded pipeline of publications
//! whose acknowledgements are taken in order.

use std::collections::VecDeque;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::header::{HeaderMap, HeaderName};
use async_nats::jetstream::{self, context::PublishAckFuture, stream};
use bytes::Bytes;
use kvbridge_shm::{ReadOutcome, RingReader};

use super::{
    SinkMetrics, ACK_TIMEOUT, HEADER_CLEARED, HEADER_DP_RANK, HEADER_MSG_ID, HEADER_RING_ID,
    HEADER_SEQ, MAX_IN_FLIGHT,
};
use crate::ring::{RecordHeader, RingHub};

type AckFuture =
    Pin<Box<dyn Future<Output = Result<jetstream::publish::PublishAck, PublishError>> + Send>>;
type PublishError = async_nats::jetstream::context::PublishError;

/// What the next publication is.
struct Item {
    /// `KvEventBatch.sequence_number` (and the `Kvbridge-Seq` header).
    seq: u64,
    payload: Bytes,
    ingest_ns: u64,
    dp_rank: Option<u32>,
    cleared: Option<&'static str>,
    /// The ring sequence to read after this one.
    next: u64,
}

struct InFlight {
    seq: u64,
    ingest_ns: u64,
    ack: AckFuture,
}

/// Where publication resumes.
#[derive(Debug, PartialEq, Eq)]
enum Resume {
    /// At this ring sequence (the stream holds everything before it).
    At(u64),
    /// The stream's last message for this subject came from another ring: this is a new ring.
    NewRing,
    /// Nothing of this subject in the stream: everything the ring retains.
    Empty,
}

enum Ended {
    Stop,
    Failed { first_unacked: u64 },
}

pub(super) struct Publisher {
    js: jetstream::Context,
    stream: stream::Stream,
    hub: Arc<RingHub>,
    /// Locked only inside the synchronous [`Publisher::read`]; the lock makes the publisher `Sync`
    /// (the reader keeps its position in `Cell`s), which its futures need.
    reader: parking_lot::Mutex<RingReader>,
    ring_id_hex: String,
    subject: String,
    /// `subject` as the client's type (cloning it is a reference count, not a copy).
    subject_bytes: async_nats::Subject,
    metrics: SinkMetrics,
    stop: tokio::sync::watch::Receiver<bool>,
    /// Local knowledge of where to restart after a failed acknowledgement.
    rewind: Option<u64>,
    /// A cleared batch to publish before anything else (a new ring).
    announce_new_ring: bool,
}

impl Publisher {
    pub(super) fn new(
        js: jetstream::Context,
        stream: stream::Stream,
        hub: Arc<RingHub>,
        subject: String,
        metrics: SinkMetrics,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let reader = hub.reader();
        let ring_id = reader.ring_id();
        // At 0 from the start, so that dashboards and alerts see the first failure.
        metrics.failures.with_label_values(&[&subject]);
        Publisher {
            js,
            stream,
            hub,
            reader: parking_lot::Mutex::new(reader),
            ring_id_hex: format!("{ring_id:016x}"),
            subject_bytes: async_nats::Subject::from(subject.as_str()),
            subject,
            metrics,
            stop,
            rewind: None,
            announce_new_ring: false,
        }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    pub(super) async fn run(mut self) {
        let mut backoff = Duration::from_millis(50);
        while !self.stopping() {
            let start = match self.rewind.take() {
                Some(s) => s,
                None => match self.resume_point().await {
                    Ok(Resume::At(s)) => s,
                    Ok(Resume::Empty) => self.hub.oldest().max(1),
                    Ok(Resume::NewRing) => {
                        self.announce_new_ring = true;
                        self.hub.oldest().max(1)
                    }
                    Err(e) => {
                        tracing::warn!(subject = %self.subject, error = %e,
                            "cannot read the last published sequence from JetStream; retrying");
                        self.pause(&mut backoff).await;
                        continue;
                    }
                },
            };
            tracing::info!(subject = %self.subject, from = start, newest = self.hub.newest(), "publishing");
            match self.pump(start).await {
                Ended::Stop => break,
                Ended::Failed { first_unacked } => {
                    self.metrics
                        .failures
                        .with_label_values(&[&self.subject])
                        .inc();
                    self.rewind = Some(first_unacked);
                    self.pause(&mut backoff).await;
                }
            }
        }
    }

    async fn pause(&mut self, backoff: &mut Duration) {
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(*backoff) => {}
            _ = stop.changed() => {}
        }
        *backoff = (*backoff * 2).min(Duration::from_secs(1));
    }

    /// Reads the last message of this subject in the stream.
    async fn resume_point(&self) -> Result<Resume, String> {
        match self
            .stream
            .get_last_raw_message_by_subject(&self.subject)
            .await
        {
            Ok(m) => {
                let h = |name: &str| m.headers.get(name).map(|v| v.as_str().to_string());
                let seq: u64 = h(HEADER_SEQ)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("the last message on {} has no {HEADER_SEQ} header (not written by kvbridge?)", self.subject))?;
                if h(HEADER_RING_ID).as_deref() != Some(self.ring_id_hex.as_str()) {
                    return Ok(Resume::NewRing);
                }
                Ok(Resume::At(seq + 1))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                Ok(Resume::Empty)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// The record at `next`, or what stands in for it; `None` when it is not committed yet.
    /// `Err(())`: the ring is gone (kvbridge is stopping).
    fn read(&mut self, next: u64) -> Result<Option<Item>, ()> {
        if self.announce_new_ring {
            self.announce_new_ring = false;
            // The numbering restarted: tell consumers their index of this worker is void, as
            // the batch before the ring's oldest record.
            return Ok(Some(self.cleared(
                next.saturating_sub(1),
                next,
                "ring_replaced",
            )));
        }
        let mut reader = self.reader.lock();
        loop {
            if self.hub.failure().is_some() {
                return Err(());
            }
            if next > self.hub.newest() {
                return Ok(None);
            }
            if reader.position() != next {
                if let Err(kvbridge_shm::SeekError::TooOld { oldest, .. }) = reader.seek(next) {
                    return Ok(Some(self.cleared(oldest - 1, oldest, "ring_lapped")));
                }
            }
            match reader.next() {
                ReadOutcome::Record(v) => {
                    let seq = v.seq();
                    let meta = v.meta();
                    let mut buf = Vec::new();
                    if !v.copy_to(&mut buf) {
                        continue; // overwritten during the copy: the seek reports it
                    }
                    return Ok(Some(Item {
                        seq,
                        payload: Bytes::from(buf),
                        ingest_ns: meta.ingest_ns,
                        dp_rank: Some(meta.dp_rank),
                        cleared: None,
                        next: seq + 1,
                    }));
                }
                ReadOutcome::Lapped { resume_at, .. } => {
                    return Ok(Some(self.cleared(resume_at - 1, resume_at, "ring_lapped")));
                }
                ReadOutcome::Corrupt { seq, .. } => {
                    self.hub.note_corrupt(seq);
                    tracing::error!(subject = %self.subject, seq,
                        "corrupt record in the ring: publishing an in-band cleared in its place");
                    return Ok(Some(self.cleared(seq, seq + 1, "corrupt")));
                }
                ReadOutcome::Empty => return Ok(None),
                ReadOutcome::RingReset { .. }
                | ReadOutcome::WriterGone
                | ReadOutcome::Truncated => return Err(()),
            }
        }
    }

    /// A synthesized `cleared` batch numbered `seq`, standing for every record up to it that the
    /// ring no longer has (built by the encoder ingest uses for its own in-band clears).
    fn cleared(&self, seq: u64, next: u64, cause: &'static str) -> Item {
        let hdr = RecordHeader {
            sequence_number: seq,
            first_event_id: 0,
            dp_rank: None,
        };
        let mut out = Vec::new();
        crate::decode::encode_cleared(&hdr, crate::clock::unix_seconds(), &mut out);
        tracing::warn!(subject = %self.subject, seq, cause,
            "records the ring no longer holds were never published: publishing an in-band cleared");
        self.metrics
            .cleared
            .with_label_values(&[&self.subject, cause])
            .inc();
        Item {
            seq,
            payload: Bytes::from(out),
            ingest_ns: crate::clock::unix_nanos(),
            dp_rank: None,
            cleared: Some(cause),
            next,
        }
    }

    async fn publish(&self, item: &Item) -> Result<PublishAckFuture, PublishError> {
        // Static names and one allocation per value: this runs for every record.
        let mut h = HeaderMap::new();
        h.insert(HeaderName::from_static(HEADER_SEQ), item.seq.to_string());
        h.insert(
            HeaderName::from_static(HEADER_RING_ID),
            self.ring_id_hex.as_str(),
        );
        if let Some(r) = item.dp_rank {
            h.insert(HeaderName::from_static(HEADER_DP_RANK), r.to_string());
        }
        if let Some(c) = item.cleared {
            h.insert(HeaderName::from_static(HEADER_CLEARED), c);
        }
        h.insert(
            HeaderName::from_static(HEADER_MSG_ID),
            format!("{}:{}", self.ring_id_hex, item.seq),
        );
        self.js
            .publish_with_headers(self.subject_bytes.clone(), h, item.payload.clone())
            .await
    }

    /// Publishes from `start` until stopped or until an acknowledgement fails.
    async fn pump(&mut self, start: u64) -> Ended {
        let mut next = start;
        let mut inflight: VecDeque<InFlight> = VecDeque::with_capacity(MAX_IN_FLIGHT);
        let lag = self.metrics.lag.with_label_values(&[&self.subject]);
        let acked = self.metrics.acked_seq.with_label_values(&[&self.subject]);
        let published = self.metrics.published.with_label_values(&[&self.subject]);
        let latency = self.metrics.latency.with_label_values(&[&self.subject]);
        let mut stop = self.stop.clone();
        loop {
            if self.stopping() {
                return self.drain(inflight).await;
            }
            // Fill the pipeline with what the ring has.
            while inflight.len() < MAX_IN_FLIGHT {
                let item = match self.read(next) {
                    Ok(Some(i)) => i,
                    Ok(None) => break,
                    Err(()) => return Ended::Stop,
                };
                let sent = tokio::time::timeout(ACK_TIMEOUT, self.publish(&item)).await;
                let ack = match sent {
                    Ok(Ok(a)) => a,
                    Ok(Err(e)) => {
                        tracing::warn!(subject = %self.subject, seq = item.seq, error = %e, "publication failed");
                        return Ended::Failed {
                            first_unacked: inflight.front().map_or(next, |f| f.seq),
                        };
                    }
                    Err(_) => {
                        tracing::warn!(subject = %self.subject, seq = item.seq, "publication not sent in time (NATS unreachable?)");
                        return Ended::Failed {
                            first_unacked: inflight.front().map_or(next, |f| f.seq),
                        };
                    }
                };
                inflight.push_back(InFlight {
                    seq: item.seq,
                    ingest_ns: item.ingest_ns,
                    ack: ack.into_future(),
                });
                next = item.next;
            }
            let room = inflight.len() < MAX_IN_FLIGHT;
            let hub = self.hub.clone();
            tokio::select! {
                r = async { inflight.front_mut().expect("checked").ack.as_mut().await }, if !inflight.is_empty() => {
                    let done = inflight.pop_front().expect("checked");
                    match r {
                        Ok(_) => {
                            published.inc();
                            acked.set(done.seq as i64);
                            lag.set(self.hub.newest().saturating_sub(done.seq) as i64);
                            let now = crate::clock::unix_nanos();
                            latency.observe(now.saturating_sub(done.ingest_ns) as f64 / 1e9);
                        }
                        Err(e) => {
                            tracing::warn!(subject = %self.subject, seq = done.seq, error = %e,
                                "publication not acknowledged; restarting from it");
                            return Ended::Failed { first_unacked: done.seq };
                        }
                    }
                }
                // No timer per wait: a ring failure and shutdown wake every waiter.
                _ = hub.wait_newer_unless(next.saturating_sub(1), || hub.failure().is_some()), if room => {
                    if inflight.is_empty() {
                        lag.set(self.hub.newest().saturating_sub(next.saturating_sub(1)) as i64);
                    }
                }
                _ = stop.changed() => {}
            }
        }
    }

    /// At stop: the acknowledgements in flight, for at most [`ACK_TIMEOUT`].
    async fn drain(&self, inflight: VecDeque<InFlight>) -> Ended {
        let deadline = tokio::time::Instant::now() + ACK_TIMEOUT;
        for f in inflight {
            if tokio::time::timeout_at(deadline, f.ack).await.is_err() {
                break;
            }
        }
        Ended::Stop
    }
}
