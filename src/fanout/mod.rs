//! Fan-out: `SubscribeKvEvents` on the four SMG service paths, served from the ring.
//!
//! Every subscriber is one cursor walking the ring (docs/smg-api.md §6.3 "Replay and live are one
//! cursor"): a resume replays `S+1 …` and then simply keeps reading as new records are
//! committed, so there is no switch-over to get wrong. Records are encoded once, at ingest; a
//! live subscriber gets the shared [`Bytes`] from the hub's recent-record cache, an older one a
//! validated copy from the ring, each as one framed gRPC message ([`EncodedBatch`]). The server
//! (`service.rs`) writes those bytes as HTTP/2 DATA as they are (`body.rs`): no per-subscriber
//! encode or copy, and with `--fanout-linger` several records in one write.
//!
//! The stream is pull-driven: the next record is read only when the transport asks for it,
//! which is when HTTP/2 flow control has room. A subscriber that stops reading therefore costs
//! nothing, never slows ingest or the others, and is caught with `DATA_LOSS` at its next read if
//! the ring overwrote its position meanwhile.
//!
//! A record read from the ring that fails its checksum (the file was modified outside kvbridge)
//! is never served either: that subscriber ends with `DATA_LOSS` naming the corrupt record, and
//! later fresh subscribers start after it (the hub remembers it). Records from the recent cache
//! were copied at commit time and need no check.

mod body;
mod call;
mod config;
mod conn;
mod load;
mod metrics;
mod service;

pub(crate) use service::{CLIENT_KEEPALIVE_INTERVAL, CLIENT_KEEPALIVE_TIMEOUT};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_shm::{ReadOutcome, RingReader, SeekError};
use tonic::Status;

use crate::ring::RingHub;

pub use config::{
    DpMode, FanoutConfig, DEFAULT_FANOUT_LINGER, DEFAULT_GRPC, DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_MAX_STREAMS_PER_CONNECTION, DEFAULT_MAX_SUBSCRIBERS, MAX_FANOUT_LINGER,
    MAX_HANDSHAKE_TIMEOUT_MS,
};
pub use conn::{serve as serve_connection, Admit, Call, Others, ServeOther, Streams};
pub use load::{with_load_records, LoadFeed, LoadSample, WithLoadRecords};
pub use metrics::FanoutMetrics;
pub use service::{edge, service_names, Edge, EdgeOptions, EdgeParts};

/// One `KvEventBatch` as the gRPC edge sends it: a length-prefixed gRPC message (the 5-byte
/// prefix, then the record's encoding). Live records are framed once, at commit, in the ring's
/// recent cache ([`crate::ring::grpc_framed`]), and every subscriber sends that same buffer.
#[derive(Clone, PartialEq)]
pub struct EncodedBatch(Bytes);

impl EncodedBatch {
    /// Frames `record` (an encoded `KvEventBatch`): one allocation and copy.
    pub fn frame(record: &[u8]) -> Self {
        EncodedBatch(crate::ring::grpc_framed(record))
    }

    /// Bytes that are already one framed message (from the ring's recent cache).
    fn from_framed(b: Bytes) -> Self {
        debug_assert!(b.len() >= crate::ring::GRPC_PREFIX_LEN);
        EncodedBatch(b)
    }

    /// The encoded `KvEventBatch`, without the gRPC prefix.
    pub fn record(&self) -> &[u8] {
        &self.0[crate::ring::GRPC_PREFIX_LEN..]
    }

    /// The framed message, as it goes on the wire.
    pub fn wire(&self) -> &Bytes {
        &self.0
    }
}

/// A record on its way to one subscriber, with what its metrics need.
pub struct Outgoing {
    /// The framed record.
    pub batch: EncodedBatch,
    /// When it was ingested (Unix ns); 0 for records kvbridge made (snapshot chunks, load).
    pub ingest_ns: u64,
    /// The subscriber's lag after this record (newest − its sequence number).
    pub lag: u64,
}

impl Outgoing {
    /// A record kvbridge made, not one ingested (no latency, no lag).
    pub fn made(batch: EncodedBatch) -> Self {
        Outgoing {
            batch,
            ingest_ns: 0,
            lag: 0,
        }
    }
}

impl std::fmt::Debug for EncodedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncodedBatch({} bytes)", self.record().len())
    }
}

/// Request metadata key selecting one rank's ring in `metadata` mode (docs/smg-api.md §7 (b)).
pub const DP_RANK_HEADER: &str = "kvbridge-dp-rank";

/// Response metadata key on `SubscribeKvEvents`: the id of the ring the stream's sequence numbers
/// belong to, 16 lowercase hex digits (the ring file's `ring_id`, shm/LAYOUT.md §3). The same id
/// after a kvbridge restart means its numbering continues; another id means a new ring (a lost
/// or unusable ring file), whose numbering starts above the old one's.
pub const RING_ID_HEADER: &str = "kvbridge-ring-id";

/// The [`RING_ID_HEADER`] value of ring `id`.
fn ring_id_value(id: u64) -> http::HeaderValue {
    format!("{id:016x}")
        .parse()
        .expect("hex digits are a valid metadata value")
}

/// Shared state of every subscription.
pub struct Fanout {
    /// The merged ring (default stream).
    pub merged: Arc<RingHub>,
    /// Per-rank rings (metadata mode), indexed by rank.
    pub ranks: Vec<Arc<RingHub>>,
    /// The edge's series (registered once, every label value at 0: [`FanoutMetrics::new`]).
    pub metrics: Arc<FanoutMetrics>,
    /// Subscriber limit.
    pub max_subscribers: usize,
    /// Subscriptions open: a count of its own (nothing is published through it), `Relaxed`.
    active: AtomicUsize,
    shutdown: tokio::sync::watch::Receiver<bool>,
    /// Sidecar mode: the engine's load samples, interleaved as `load_only` records for
    /// subscribers that set request field 2 (docs/smg-api.md §3.5; see `crate::proxy`).
    load_feed: std::sync::OnceLock<LoadFeed>,
    /// Snapshot tables; `None`: the retained window only.
    snapshots: Option<crate::snapshot::Snapshots>,
    /// How long a stream's ready records wait for more before they are written (`--fanout-linger`).
    linger: Duration,
}

/// Every `outcome` of `kvbridge_subscribe_outcomes_total` (docs/operations.md).
const SUBSCRIBE_OUTCOMES: [&str; 8] = [
    "fresh",
    "snapshot",
    "in_window",
    "at_head",
    "out_of_range_old",
    "out_of_range_future",
    "data_loss",
    "rejected_limit",
];

impl Fanout {
    /// Fan-out over these rings; `shutdown` turning true ends every stream with `UNAVAILABLE`.
    pub fn new(
        merged: Arc<RingHub>,
        ranks: Vec<Arc<RingHub>>,
        metrics: Arc<FanoutMetrics>,
        max_subscribers: usize,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Fanout {
            merged,
            ranks,
            metrics,
            max_subscribers,
            active: AtomicUsize::new(0),
            shutdown,
            load_feed: std::sync::OnceLock::new(),
            snapshots: None,
            linger: Duration::ZERO,
        }
    }

    /// Ready records wait at most `linger` for more before they are written together
    /// (`--fanout-linger`; zero: written at once).
    pub fn with_linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Sidecar mode: send the engine's load samples to subscribers that ask for load records.
    /// Set once, before serving; later calls are ignored.
    pub fn attach_load_feed(&self, feed: LoadFeed) {
        let _ = self.load_feed.set(feed);
    }

    /// Serves snapshots from these tables to subscribers starting from 0 (docs/smg-api.md §6.5).
    pub fn with_snapshots(mut self, s: crate::snapshot::Snapshots) -> Self {
        self.snapshots = Some(s);
        self
    }

    /// The snapshot tables, if any.
    pub fn snapshots(&self) -> Option<&crate::snapshot::Snapshots> {
        self.snapshots.as_ref()
    }

    /// Number of open subscriptions.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    fn status(&self, s: Status) -> Status {
        self.metrics
            .statuses
            .with_label_values(&[code_label(s.code())])
            .inc();
        s
    }

    /// Classifies a request against one view of (O, N) and opens the subscription, or answers
    /// with the status SMG gateways act on (docs/smg-api.md §6.2). Runs before response headers.
    /// `takes_chunks`: the request set field 2 (`load_records_before_first_batch`).
    pub fn subscribe(
        self: &Arc<Self>,
        path: &'static str,
        start: u64,
        rank_header: Option<&[u8]>,
        takes_chunks: bool,
    ) -> Result<Subscription, Status> {
        if *self.shutdown.borrow() {
            return Err(self.status(Status::unavailable(
                "kvbridge is shutting down; resubscribe with the same cursor",
            )));
        }
        let hub = self.ring_for(rank_header)?;
        let guard = self.admit(path)?;
        let mut reader = hub.reader();
        // Snapshot: chunks numbered up to the cut, then the ring from cut + 1.
        let snapshot = self
            .snapshots
            .as_ref()
            .and_then(|s| s.for_subscriber(&hub, start, takes_chunks));
        if let Some(c) = &snapshot {
            self.metrics.resumes.with_label_values(&["snapshot"]).inc();
            if reader.seek(c.cut + 1).is_ok() {
                return Ok(Subscription {
                    hub,
                    reader,
                    next: c.cut + 1,
                    path,
                    shutdown: self.shutdown.clone(),
                    done: false,
                    last_ingest_ns: 0,
                    metrics: self.metrics.clone(),
                    pending: c.framed.iter().rev().cloned().collect(),
                    _guard: guard,
                });
            }
            // The ring moved past the cut while the snapshot was built: the window instead.
        }
        let next = self.classify(&hub, start)?;
        let next = self.seek_start(&mut reader, next, start)?;
        Ok(Subscription {
            hub,
            reader,
            next,
            path,
            shutdown: self.shutdown.clone(),
            done: false,
            last_ingest_ns: 0,
            metrics: self.metrics.clone(),
            pending: Vec::new(),
            _guard: guard,
        })
    }

    /// The ring a request reads: the merged one, or in `metadata` mode the rank its
    /// [`DP_RANK_HEADER`] names.
    fn ring_for(&self, rank_header: Option<&[u8]>) -> Result<Arc<RingHub>, Status> {
        let Some(raw) = rank_header else {
            return Ok(self.merged.clone());
        };
        let r: usize = std::str::from_utf8(raw)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| {
                self.status(Status::invalid_argument(format!(
                    "{DP_RANK_HEADER} must be a rank number"
                )))
            })?;
        if self.ranks.is_empty() {
            return Err(self.status(Status::not_found(format!(
                "{DP_RANK_HEADER}: per-rank streams are off (start kvbridge with --dp-mode metadata)"
            ))));
        }
        self.ranks.get(r).cloned().ok_or_else(|| {
            self.status(Status::not_found(format!(
                "{DP_RANK_HEADER}: no rank {r} (this bridge has {})",
                self.ranks.len()
            )))
        })
    }

    /// Admission against the subscriber limit: counted first, then checked, so concurrent
    /// subscribes cannot overshoot. The guard gives the place back when the stream ends.
    fn admit(self: &Arc<Self>, path: &'static str) -> Result<ActiveGuard, Status> {
        let n = self.active.fetch_add(1, Ordering::Relaxed) + 1;
        let mut guard = ActiveGuard {
            fanout: self.clone(),
            path,
            gauge: false,
        };
        if n > self.max_subscribers {
            drop(guard);
            self.metrics
                .resumes
                .with_label_values(&["rejected_limit"])
                .inc();
            return Err(self.status(Status::resource_exhausted(format!(
                "subscriber limit {} reached; retry later",
                self.max_subscribers
            ))));
        }
        self.metrics.subscribers.with_label_values(&[path]).inc();
        guard.gauge = true;
        Ok(guard)
    }

    /// Classifies `start` against one view of the window (O, N) of `hub` (docs/smg-api.md
    /// §6.2), counting the outcome: the first sequence number to read, or the status.
    fn classify(&self, hub: &RingHub, start: u64) -> Result<u64, Status> {
        let (o, n) = hub.window();
        // A record found corrupt is the effective start of the window while it is retained.
        let o = hub.readable_from(o).min(n + 1);
        if start == 0 {
            self.metrics.resumes.with_label_values(&["fresh"]).inc();
            Ok(o)
        } else if start > n {
            self.metrics
                .resumes
                .with_label_values(&["out_of_range_future"])
                .inc();
            Err(self.status(Status::out_of_range(format!(
                "start_sequence_number {start} is ahead of newest {n}: ring reset or different source; resubscribe from 0"
            ))))
        } else if start.saturating_add(1) < o {
            self.metrics
                .resumes
                .with_label_values(&["out_of_range_old"])
                .inc();
            Err(self.status(too_old(start, o, n)))
        } else {
            self.metrics
                .resumes
                .with_label_values(&[if start == n { "at_head" } else { "in_window" }])
                .inc();
            Ok(start + 1)
        }
    }

    /// Positions `reader` at `next`, the first record of a request from `start`; returns where
    /// it ended up.
    fn seek_start(&self, reader: &mut RingReader, next: u64, start: u64) -> Result<u64, Status> {
        let mut next = next;
        let mut attempts = 0;
        loop {
            match reader.seek(next) {
                Ok(()) => return Ok(next),
                // The writer moved on between the window read and the seek. A fresh subscriber
                // (S = 0) simply starts at the new oldest record; a resume is now too old.
                Err(SeekError::TooOld { oldest, .. }) if start == 0 && attempts < 100 => {
                    attempts += 1;
                    next = oldest;
                    continue;
                }
                Err(SeekError::TooOld { oldest, newest, .. }) => {
                    return Err(self.status(too_old(start, oldest, newest)));
                }
                Err(SeekError::Future { newest, .. }) => {
                    return Err(self.status(Status::out_of_range(format!(
                    "start_sequence_number {start} is ahead of newest {newest}; resubscribe from 0"
                ))));
                }
            }
        }
    }
}

fn too_old(start: u64, o: u64, n: u64) -> Status {
    Status::out_of_range(format!(
        "start_sequence_number {start} is older than the retained window [{o}, {n}]; resubscribe from 0"
    ))
}

/// gRPC code as a metric label.
pub fn code_label(c: tonic::Code) -> &'static str {
    match c {
        tonic::Code::Ok => "ok",
        tonic::Code::OutOfRange => "out_of_range",
        tonic::Code::DataLoss => "data_loss",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::ResourceExhausted => "resource_exhausted",
        tonic::Code::NotFound => "not_found",
        tonic::Code::InvalidArgument => "invalid_argument",
        tonic::Code::Unauthenticated => "unauthenticated",
        tonic::Code::Internal => "internal",
        _ => "other",
    }
}

struct ActiveGuard {
    fanout: Arc<Fanout>,
    path: &'static str,
    gauge: bool,
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.fanout.active.fetch_sub(1, Ordering::Relaxed);
        if self.gauge {
            self.fanout
                .metrics
                .subscribers
                .with_label_values(&[self.path])
                .dec();
        }
    }
}

/// One subscriber's cursor over a ring.
pub struct Subscription {
    hub: Arc<RingHub>,
    reader: RingReader,
    next: u64,
    path: &'static str,
    shutdown: tokio::sync::watch::Receiver<bool>,
    done: bool,
    last_ingest_ns: u64,
    metrics: Arc<FanoutMetrics>,
    /// Snapshot chunks still to send (framed, as the edge sends them), last first.
    pending: Vec<Bytes>,
    _guard: ActiveGuard,
}

impl Subscription {
    /// The id of the ring this subscription reads ([`RING_ID_HEADER`]).
    pub fn ring_id(&self) -> u64 {
        self.reader.ring_id()
    }

    /// The next record for this subscriber: waits for it when the cursor is at the head; ends
    /// with `DATA_LOSS` when the ring overwrote it, `UNAVAILABLE` at shutdown. `None` after an
    /// error has been returned.
    pub async fn next_batch(&mut self) -> Option<Result<Outgoing, Status>> {
        if self.done {
            return None;
        }
        match self.next_inner().await {
            Ok(batch) => Some(Ok(Outgoing {
                batch,
                ingest_ns: self.last_ingest_ns,
                lag: self.lag(),
            })),
            Err(s) => {
                self.done = true;
                Some(Err(s))
            }
        }
    }

    async fn next_inner(&mut self) -> Result<EncodedBatch, Status> {
        if let Some(chunk) = self.pending.pop() {
            self.last_ingest_ns = 0;
            return Ok(EncodedBatch::from_framed(chunk));
        }
        loop {
            if *self.shutdown.borrow() {
                return Err(Status::unavailable(
                    "kvbridge is shutting down; resubscribe with the same cursor",
                ));
            }
            if let Some(why) = self.hub.failure() {
                return Err(Status::unavailable(format!(
                    "ring {} is unusable ({why}); kvbridge is stopping",
                    self.hub.label()
                )));
            }
            // Overwritten in the ring: whatever a cache still holds, the subscriber fell behind
            // the retained window, and resuming past the hole would be a silent skip.
            let oldest = self.hub.oldest();
            if self.next < oldest {
                return Err(self.lapped(oldest));
            }
            if let Some((b, ingest_ns)) = self.hub.cached_at(self.next) {
                self.last_ingest_ns = ingest_ns;
                self.next += 1;
                return Ok(EncodedBatch::from_framed(b));
            }
            if self.next > self.hub.newest() {
                // Shutdown and a ring failure both wake every waiter after setting their flag.
                let (hub, shutdown) = (&self.hub, &self.shutdown);
                hub.wait_newer_unless(self.next - 1, || {
                    *shutdown.borrow() || hub.failure().is_some()
                })
                .await;
                continue;
            }
            // Older than the cache: read the ring.
            if self.reader.position() != self.next {
                if let Err(SeekError::TooOld { oldest, .. }) = self.reader.seek(self.next) {
                    return Err(self.lapped(oldest));
                }
            }
            match self.reader.next() {
                ReadOutcome::Record(v) => {
                    debug_assert_eq!(v.seq(), self.next);
                    let ingest_ns = v.meta().ingest_ns;
                    // Copied out (validated), then framed: catch-up beyond the cache only, and
                    // nothing the size of the largest record kept per subscriber afterwards.
                    let mut record = Vec::new();
                    if !v.copy_to(&mut record) {
                        continue; // overwritten during the copy: the seek above reports it
                    }
                    self.last_ingest_ns = ingest_ns;
                    self.next += 1;
                    return Ok(EncodedBatch::frame(&record));
                }
                ReadOutcome::Lapped { resume_at, .. } => return Err(self.lapped(resume_at)),
                ReadOutcome::Corrupt { seq, .. } => return Err(self.corrupt(seq)),
                ReadOutcome::Empty => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                ReadOutcome::RingReset { .. } | ReadOutcome::WriterGone => {
                    return Err(Status::unavailable(
                        "ring writer restarted; resubscribe with the same cursor",
                    ));
                }
                ReadOutcome::Truncated => {
                    return Err(Status::unavailable(
                        "the ring file was truncated under kvbridge; resubscribe with the same cursor once it is back",
                    ));
                }
            }
        }
    }

    fn lapped(&self, oldest: u64) -> Status {
        let m = &self.metrics;
        self.hub.count_reader_lap();
        m.slow_disconnects.with_label_values(&[self.path]).inc();
        let last = self.next - 1;
        let missed = oldest.saturating_sub(self.next);
        Status::data_loss(format!(
            "fell behind: last delivered {last}, oldest retained {oldest}, {missed} batches missed; resubscribe from 0"
        ))
    }

    /// Record `seq` failed its checksum in the ring: never served, and never skipped silently.
    fn corrupt(&self, seq: u64) -> Status {
        self.hub.note_corrupt(seq);
        self.hub.count_corrupt_read();
        tracing::error!(ring = self.hub.label(), seq, path = self.path,
            "corrupt record in the ring (checksum mismatch or damaged header): ending the subscriber with DATA_LOSS");
        Status::data_loss(format!(
            "corrupt record: batch {seq} in the ring failed its checksum (the ring file was modified \
             outside kvbridge); last delivered {}; resubscribe from 0",
            self.next - 1
        ))
    }

    /// Newest sequence minus the one `next_batch` returned last.
    pub fn lag(&self) -> u64 {
        self.hub
            .newest()
            .saturating_sub(self.next.saturating_sub(1))
    }
}
