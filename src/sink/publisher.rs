//! One ring's publisher: where the stream's copy of the subject ends, then atomic batches, each
//! one stored only right after the last message JetStream holds for the subject.
//!
//! # Why atomic batches with an expected-last-subject-sequence
//!
//! The reorder this prevents: with many plain publications in flight, the ones routed to a
//! failing stream leader are lost while later ones reach the new leader; re-publishing from the
//! first unacknowledged record then stores the lost ones *after* the later ones (de-duplication
//! keeps those where they are). What JetStream offers against it, as nats-server 2.15 has it:
//!
//! - `Nats-Expected-Last-Msg-Id` compares with the last message id of the whole *stream*
//!   (`mset.lmsgId`), not of the subject: with the merged ring, the rank rings and other bridges
//!   publishing into one stream, every interleaving would be "rejected". Unusable here (and it is
//!   refused inside atomic batches, error 10177).
//! - `Nats-Expected-Last-Subject-Sequence` on *every* message needs the stream sequence of the
//!   record before, which is not known before its acknowledgement (other subjects share the
//!   stream's numbering); and a clustered stream refuses such a check while the subject has any
//!   proposal in flight (error 10164, "wrong last sequence"): one round trip per record, the
//!   throughput this must not lose.
//! - An atomic batch (`Nats-Batch-Id`, `Nats-Batch-Sequence`, `Nats-Batch-Commit`, stream
//!   `allow_atomic`, nats-server ≥ 2.12) is stored whole or not at all, and its first message may
//!   carry `Nats-Expected-Last-Subject-Sequence`, checked under the stream's lock at commit. So the
//!   publisher sends one batch at a time — the records the ring has, up to [`MAX_BATCH`], sent
//!   back to back without waiting (the pipelining), then the commit as a request — and each
//!   batch names the stream sequence of the last message on the subject that the previous
//!   acknowledgement (or the stream itself) reported. A batch whose predecessor is missing
//!   cannot be stored; a batch cut by a leader change is abandoned whole ("incomplete",
//!   10176). After a passing failure the same records are sent again after the same message;
//!   when that is refused (the first attempt was stored after all), and after any other refusal,
//!   the publisher asks the stream where the subject ends and goes on from there. While records arrive faster than a commit round trip, batches grow by
//!   themselves, so the cost is one round trip per batch, not per record
//!   (`scripts/nats-bench.sh` measures it against the bare pipelined publisher; docs/nats-sink.md).
//!
//! `Nats-Msg-Id` stays on every message (a re-sent batch of which a message is already stored is
//! refused whole, 10201: the publisher then re-reads where the subject ends, as after a rejection).

use std::sync::Arc;
use std::time::Duration;

use async_nats::header::{HeaderMap, HeaderName};
use async_nats::jetstream::stream;
use bytes::Bytes;
use kvbridge_shm::{ReadOutcome, RingReader};

use super::{
    SinkMetrics, ACK_TIMEOUT, HEADER_CLEARED, HEADER_DP_RANK, HEADER_MSG_ID, HEADER_RING_ID,
    HEADER_SEQ, MAX_BATCH,
};
use crate::ring::{RecordHeader, RingHub};

/// Header: the atomic batch a message belongs to.
const HEADER_BATCH_ID: &str = "Nats-Batch-Id";
/// Header: the message's position in its batch, from 1.
const HEADER_BATCH_SEQ: &str = "Nats-Batch-Sequence";
/// Header, on a batch's last message: `1`, commit the batch (this message included).
const HEADER_BATCH_COMMIT: &str = "Nats-Batch-Commit";
/// Header, on a batch's first message: the stream sequence of the subject's last message (0: none).
const HEADER_EXPECTED_LAST_SUBJECT_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";

/// JetStream error codes (nats-server `server/errors.json`) the publisher tells apart.
mod code {
    /// `wrong last sequence: {seq}`: the subject's last message is not the one named.
    pub(super) const WRONG_LAST_SEQUENCE: u64 = 10071;
    /// `wrong last sequence`: the subject had a proposal in flight when the batch was checked.
    pub(super) const WRONG_LAST_SEQUENCE_CONSTANT: u64 = 10164;
    /// `duplicate message id is in process`.
    pub(super) const DUPLICATE_IN_PROCESS: u64 = 10158;
    /// `atomic publish batch contains duplicate message id`.
    pub(super) const BATCH_DUPLICATE: u64 = 10201;
    /// `atomic publish is disabled` (the stream lost `allow_atomic`).
    pub(super) const ATOMIC_DISABLED: u64 = 10174;
    /// `atomic publish batch is too large: {size}` (a server limit below [`super::MAX_BATCH`]).
    pub(super) const BATCH_TOO_LARGE: u64 = 10199;
}

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

/// Why a batch was not stored.
#[derive(Debug)]
enum Failure {
    /// Its predecessor is not the subject's last message (an earlier batch was lost, or stored
    /// after all): nothing of it was stored.
    Order(String),
    /// Part of it is already in the stream (an earlier attempt was stored after all).
    Duplicate,
    /// The server allows smaller batches than this one.
    TooLarge,
    /// The stream refuses atomic batches: a configuration problem, not a passing one.
    Config(String),
    /// Unreachable, timed out, leader change (batch abandoned), or any other refusal.
    Transient(String),
}

/// The publisher's state, logged once per change.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Starting,
    Publishing,
    Realigning,
    Failing(&'static str),
}

enum Ended {
    Stop,
    /// Try again: from this (stream sequence, ring sequence) when known locally, else from where
    /// the stream says the subject ends.
    Retry(Option<(u64, u64)>),
}

/// Capped exponential backoff.
struct Backoff(Duration);

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const CAP: Duration = Duration::from_secs(1);
    fn reset(&mut self) {
        self.0 = Self::FIRST;
    }
    fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(Self::CAP);
        d
    }
}

pub(super) struct Publisher {
    client: async_nats::Client,
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
    /// A cleared batch to publish before anything else (a new ring).
    announce_new_ring: bool,
    /// Last ring sequence JetStream holds for this subject (0: none known).
    acked: u64,
    /// Highest ring sequence ever sent: records at or below it sent again are "republished".
    high_sent: u64,
    /// Records per batch at most (lowered if the server's limit is lower).
    batch_cap: usize,
    /// Batch ids: `<ring id>-<nonce>-<counter>`, unique across restarts of the process.
    batch_nonce: u64,
    batches: u64,
    state: State,
}

impl Publisher {
    pub(super) fn new(
        client: async_nats::Client,
        stream: stream::Stream,
        hub: Arc<RingHub>,
        subject: String,
        metrics: SinkMetrics,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let reader = hub.reader();
        let ring_id = reader.ring_id();
        Publisher {
            client,
            stream,
            hub,
            reader: parking_lot::Mutex::new(reader),
            ring_id_hex: format!("{ring_id:016x}"),
            subject_bytes: async_nats::Subject::from(subject.as_str()),
            subject,
            metrics,
            stop,
            announce_new_ring: false,
            acked: 0,
            high_sent: 0,
            batch_cap: MAX_BATCH,
            batch_nonce: crate::clock::unix_nanos(),
            batches: 0,
            state: State::Starting,
        }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Logs a change of state (not a repetition of one).
    fn set_state(&mut self, s: State, why: &str) {
        if self.state == s {
            return;
        }
        match &s {
            State::Publishing => tracing::info!(subject = %self.subject, from = self.acked + 1,
                newest = self.hub.newest(), "publishing to JetStream"),
            State::Realigning => tracing::info!(subject = %self.subject, why,
                "a batch was refused for order; resuming after the stream's last record"),
            State::Failing(kind) => tracing::warn!(subject = %self.subject, kind, error = why,
                "cannot publish to JetStream; retrying (the ring keeps the records meanwhile)"),
            State::Starting => {}
        }
        self.state = s;
    }

    pub(super) async fn run(mut self) {
        let mut backoff = Backoff(Backoff::FIRST);
        let mut local = None;
        while !self.stopping() {
            let resume = match local.take() {
                Some((s, n)) => Ok((s, Resume::At(n))),
                None => self.resume_point().await,
            };
            let (stream_seq, start) = match resume {
                Ok((s, Resume::At(n))) => {
                    self.acked = n - 1;
                    (s, n)
                }
                Ok((s, Resume::Empty)) => (s, self.hub.oldest().max(1)),
                Ok((s, Resume::NewRing)) => {
                    self.announce_new_ring = true;
                    (s, self.hub.oldest().max(1))
                }
                Err(e) => {
                    self.set_state(State::Failing("resume"), &e);
                    self.pause(&mut backoff).await;
                    continue;
                }
            };
            match self.pump(stream_seq, start, &mut backoff).await {
                Ended::Stop => break,
                Ended::Retry(l) => {
                    local = l;
                    self.pause(&mut backoff).await
                }
            }
        }
    }

    async fn pause(&mut self, backoff: &mut Backoff) {
        self.report_lag();
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(backoff.next()) => {}
            _ = stop.changed() => {}
        }
    }

    /// Lag gauges: records the ring has that JetStream does not, and the age of the oldest.
    fn report_lag(&self) {
        let newest = self.hub.newest();
        let behind = newest.saturating_sub(self.acked);
        self.metrics
            .lag
            .with_label_values(&[&self.subject])
            .set(behind as i64);
        let age = if behind == 0 {
            0.0
        } else {
            self.ingest_ns(self.acked + 1).map_or(0.0, |t| {
                crate::clock::unix_nanos().saturating_sub(t) as f64 / 1e9
            })
        };
        self.metrics
            .lag_seconds
            .with_label_values(&[&self.subject])
            .set(age);
    }

    /// When the record at `seq` (or the ring's oldest, if `seq` is gone) entered the ring.
    fn ingest_ns(&self, seq: u64) -> Option<u64> {
        let mut reader = self.reader.lock();
        let seq = seq.max(self.hub.oldest());
        reader.seek(seq).ok()?;
        match reader.next() {
            ReadOutcome::Record(v) => Some(v.meta().ingest_ns),
            _ => None,
        }
    }

    /// The last message of this subject in the stream: its stream sequence (0: none) and where
    /// publishing resumes.
    async fn resume_point(&self) -> Result<(u64, Resume), String> {
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
                    return Ok((m.sequence, Resume::NewRing));
                }
                Ok((m.sequence, Resume::At(seq + 1)))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                Ok((0, Resume::Empty))
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

    /// The wire contract's headers of one record.
    fn headers(&self, item: &Item) -> HeaderMap {
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
        h
    }

    /// Sends `batch` as one atomic batch stored only right after stream sequence `after` (the
    /// subject's last message; 0: none), and returns the stream sequence of its last message.
    async fn send_batch(&mut self, batch: &[Item], after: u64) -> Result<u64, Failure> {
        self.batches += 1;
        let id = format!(
            "{}-{:x}-{:x}",
            self.ring_id_hex, self.batch_nonce, self.batches
        );
        let n = batch.len();
        for (i, item) in batch.iter().enumerate() {
            let mut h = self.headers(item);
            h.insert(HeaderName::from_static(HEADER_BATCH_ID), id.as_str());
            h.insert(
                HeaderName::from_static(HEADER_BATCH_SEQ),
                (i + 1).to_string(),
            );
            if i == 0 {
                h.insert(
                    HeaderName::from_static(HEADER_EXPECTED_LAST_SUBJECT_SEQ),
                    after.to_string(),
                );
            }
            if i + 1 < n {
                // No reply asked: a failure of any of these fails the commit.
                let sent = self.client.publish_with_headers(
                    self.subject_bytes.clone(),
                    h,
                    item.payload.clone(),
                );
                match tokio::time::timeout(ACK_TIMEOUT, sent).await {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => return Err(Failure::Transient(e.to_string())),
                    Err(_) => {
                        return Err(Failure::Transient(
                            "publication not sent in time (NATS unreachable?)".into(),
                        ))
                    }
                }
            }
            h.insert(HeaderName::from_static(HEADER_BATCH_COMMIT), "1");
            let req = async_nats::Request::new()
                .headers(h)
                .payload(item.payload.clone())
                .timeout(Some(ACK_TIMEOUT));
            let reply = tokio::time::timeout(
                ACK_TIMEOUT + Duration::from_secs(1),
                self.client.send_request(self.subject_bytes.clone(), req),
            )
            .await
            .map_err(|_| Failure::Transient("commit not sent in time (NATS unreachable?)".into()))?
            .map_err(|e| Failure::Transient(format!("commit: {e}")))?;
            return parse_commit_reply(&reply.payload, n);
        }
        unreachable!("a batch has at least one record")
    }

    /// Publishes from ring sequence `start`, the subject's last message being stream sequence
    /// `stream_seq`, until stopped or until a batch is not stored.
    async fn pump(&mut self, stream_seq: u64, start: u64, backoff: &mut Backoff) -> Ended {
        let mut next = start;
        let mut after = stream_seq;
        let subject = self.subject.clone();
        let acked_seq = self.metrics.acked_seq.with_label_values(&[&subject]);
        let published = self.metrics.published.with_label_values(&[&subject]);
        let latency = self.metrics.latency.with_label_values(&[&subject]);
        let republished = self.metrics.republished.with_label_values(&[&subject]);
        let mut stop = self.stop.clone();
        let mut batch: Vec<Item> = Vec::with_capacity(self.batch_cap);
        loop {
            if self.stopping() {
                return Ended::Stop;
            }
            batch.clear();
            while batch.len() < self.batch_cap {
                match self.read(next) {
                    Ok(Some(i)) => {
                        next = i.next;
                        batch.push(i);
                    }
                    Ok(None) => break,
                    Err(()) => return Ended::Stop,
                }
            }
            if batch.is_empty() {
                self.report_lag();
                let hub = self.hub.clone();
                // No timer per wait: a ring failure and shutdown wake every waiter.
                tokio::select! {
                    _ = hub.wait_newer_unless(next.saturating_sub(1), || hub.failure().is_some()) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
            let again = batch
                .iter()
                .filter(|i| i.seq <= self.high_sent && i.cleared.is_none())
                .count();
            republished.inc_by(again as u64);
            self.high_sent = self.high_sent.max(batch.last().map_or(0, |i| i.seq));
            match self.send_batch(&batch, after).await {
                Ok(last) => {
                    after = last;
                    let now = crate::clock::unix_nanos();
                    for i in &batch {
                        latency.observe(now.saturating_sub(i.ingest_ns) as f64 / 1e9);
                    }
                    published.inc_by(batch.len() as u64);
                    self.acked = batch.last().map_or(self.acked, |i| i.seq);
                    acked_seq.set(self.acked as i64);
                    self.report_lag();
                    backoff.reset();
                    self.set_state(State::Publishing, "");
                }
                Err(f) => return Ended::Retry(self.on_failure(f, &batch, after)),
            }
        }
    }

    /// Records why `batch` (sent after stream sequence `after`) was not stored: the state, the
    /// counters, a smaller batch cap. Returns where to resume without asking the stream (a
    /// passing failure of a batch that is not a synthesized first record), as
    /// [`Ended::Retry`] carries it.
    fn on_failure(&mut self, f: Failure, batch: &[Item], after: u64) -> Option<(u64, u64)> {
        let subject = self.subject.clone();
        let first = batch[0].seq;
        // After a passing failure, the batch is sent again after the same message:
        // if it was stored after all, that is refused (for order or as a duplicate)
        // and only then is the stream asked where the subject ends. A synthesized
        // first record is re-derived from the stream instead.
        let mut local = None;
        match f {
            Failure::Order(why) => {
                self.metrics
                    .rejected_for_order
                    .with_label_values(&[&subject])
                    .inc_by(batch.len() as u64);
                self.set_state(State::Realigning, &why);
            }
            Failure::Duplicate => {
                self.set_state(State::Realigning, "part of the batch is already stored")
            }
            Failure::TooLarge => {
                self.batch_cap = (self.batch_cap / 2).max(1);
                tracing::info!(subject = %subject, cap = self.batch_cap,
                    "the server allows smaller atomic batches: sending at most this many records per batch");
            }
            Failure::Config(why) => {
                self.metrics.config_errors.inc();
                if self.state != State::Failing("config") {
                    tracing::error!(subject = %subject, error = %why,
                        "the stream refuses atomic batches; publishing waits until it allows them (allow_atomic)");
                }
                self.state = State::Failing("config");
            }
            Failure::Transient(why) => {
                self.metrics.failures.with_label_values(&[&subject]).inc();
                tracing::debug!(subject = %subject, first, error = %why, "batch not stored");
                self.set_state(State::Failing("publish"), &why);
                if batch[0].cleared.is_none() {
                    local = Some((after, first));
                }
            }
        }
        local
    }
}

/// JetStream's answer to a batch's commit: the stream sequence of the batch's last message.
fn parse_commit_reply(payload: &[u8], n: usize) -> Result<u64, Failure> {
    #[derive(serde::Deserialize)]
    struct ApiError {
        #[serde(default)]
        err_code: u64,
        #[serde(default)]
        description: String,
    }
    #[derive(serde::Deserialize)]
    struct Reply {
        #[serde(default)]
        seq: u64,
        #[serde(default)]
        count: Option<u64>,
        error: Option<ApiError>,
    }
    let r: Reply = serde_json::from_slice(payload).map_err(|e| {
        Failure::Transient(format!(
            "commit answered {:?}: {e}",
            String::from_utf8_lossy(payload)
        ))
    })?;
    if let Some(e) = r.error {
        let why = format!("{} (JetStream error {})", e.description, e.err_code);
        return Err(match e.err_code {
            code::WRONG_LAST_SEQUENCE | code::WRONG_LAST_SEQUENCE_CONSTANT => Failure::Order(why),
            code::BATCH_DUPLICATE | code::DUPLICATE_IN_PROCESS => Failure::Duplicate,
            code::ATOMIC_DISABLED => Failure::Config(why),
            code::BATCH_TOO_LARGE => Failure::TooLarge,
            _ => Failure::Transient(why),
        });
    }
    match r.count {
        Some(c) if c == n as u64 && r.seq >= c => Ok(r.seq),
        // A server without atomic batches stores the commit message alone, as a plain publish.
        None => Err(Failure::Config(
            "the commit was acknowledged as a single message: the server has no atomic batch publish (nats-server ≥ 2.12 needed)".into(),
        )),
        Some(c) => Err(Failure::Transient(format!(
            "commit acknowledged {c} messages, not {n}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_replies_are_classified_by_jetstream_error_code() {
        let ok = br#"{"stream":"S","seq":42,"batch":"b","count":3}"#;
        assert_eq!(parse_commit_reply(ok, 3).ok(), Some(42));
        let err = |code: u64| {
            let p = format!(
                r#"{{"error":{{"code":400,"err_code":{code},"description":"x"}},"stream":"S","seq":0}}"#
            );
            parse_commit_reply(p.as_bytes(), 3).unwrap_err()
        };
        assert!(matches!(err(10071), Failure::Order(_)));
        assert!(matches!(err(10164), Failure::Order(_)));
        assert!(matches!(err(10201), Failure::Duplicate));
        assert!(matches!(err(10174), Failure::Config(_)));
        assert!(matches!(err(10199), Failure::TooLarge));
        assert!(matches!(err(10176), Failure::Transient(_)));
        // A server that ignores the batch headers acknowledges one message.
        let plain = br#"{"stream":"S","seq":7}"#;
        assert!(matches!(
            parse_commit_reply(plain, 3),
            Err(Failure::Config(_))
        ));
        assert!(matches!(
            parse_commit_reply(b"garbage", 3),
            Err(Failure::Transient(_))
        ));
    }
}
