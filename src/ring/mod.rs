//! The service's side of the shared-memory ring (`kvbridge-shm`): one [`RingHub`] per ring file.
//!
//! The hub is where encoded records get their numbers. It owns the ring's only writer (behind a
//! mutex, because every ingest rank publishes into the merged ring), assigns `event_id`s, keeps
//! the most recent records as shared [`Bytes`], framed as the gRPC messages the edge sends
//! (`cache.rs`), so that live subscribers copy nothing of their own, counts what it wrote
//! (`gauges.rs`), and wakes in-process subscribers after each commit. Readers in other processes use the ring file directly and are woken by the ring's
//! futex.
//!
//! What a record contains is the source's business ([`RecordSource`]): the ring never imports
//! the decoder.
//!
//! Ordering: a record is pushed to the cache and `newest` is raised while the writer lock is
//! held, so `newest` only moves forward and the cache always ends at `newest`, whichever rank
//! publishes. A subscriber that sees `newest ≥ s` finds `s` in the cache or in the ring.

mod cache;
mod config;
mod files;
mod gauges;
mod metrics;
mod set;
mod source;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvbridge_shm::layout::{NOTES_MAX, NOTE_LEN};
use kvbridge_shm::{
    ReadOutcome, RecordMeta, Replaced, RingReader, RingWriter, ShmError, WriterOptions,
};
use parking_lot::{Mutex, RwLock};
use prost::Message;
use thiserror::Error;

pub use cache::{grpc_framed, GRPC_PREFIX_LEN};
use cache::{RecentCache, CACHE_MAX_BYTES};
pub use config::{
    RingConfig, DEFAULT_RING_SIZE, DEFAULT_SPLIT_THRESHOLD, MAX_RING_SIZE, MAX_SPLIT_THRESHOLD,
    MIN_RING_SIZE, MIN_SPLIT_THRESHOLD,
};
pub use files::{remove_tmps_of, tmp_of, RingFiles};
pub use gauges::spawn_heartbeat;
use gauges::RingGauges;
pub use metrics::RingMetrics;
pub use set::RingSet;
pub use source::{
    ClearCause, EventVisitor, RecordHeader, RecordSource, StoredEvent, FLAG_SIGNED_HASHES,
    FLAG_SYNTHESIZED,
};

/// Something that must see every published source at the instant it becomes part of the ring:
/// called under the writer lock, after the source's last record is committed, so that no reader
/// of the hook's state can observe a ring and a state that disagree (the snapshot table's cut).
pub trait PublishHook: Send + Sync {
    /// `src` was published as `records` (their bytes, in order) ending at `last_seq`, with ring
    /// metadata `meta`.
    fn published(
        &self,
        src: &dyn RecordSource,
        records: &[Bytes],
        meta: &RecordMeta,
        last_seq: u64,
    );
}

/// Ring errors at the service edge.
#[derive(Debug, Error)]
pub enum RingError {
    /// Opening or creating the ring file failed.
    #[error("ring {path}: {source}")]
    Open {
        /// Ring file.
        path: String,
        /// Cause.
        source: ShmError,
    },
    /// Writing a record failed.
    #[error("ring write: {0}")]
    Write(#[from] ShmError),
}

struct WriterState {
    writer: RingWriter,
    /// What the ring's writer notes hold (written through [`RingHub::update_notes`]).
    notes: Vec<[u8; NOTE_LEN]>,
    next_event_id: u64,
    /// The records of the source being published, for the hook (capacity kept: no allocation
    /// per publish in steady state; emptied before the lock is released).
    published: Vec<Bytes>,
}

/// One ring: its writer, a reader template, the recent-record cache and the wake-up signal.
pub struct RingHub {
    label: String,
    writer: Mutex<WriterState>,
    /// A reader to clone (readers keep per-reader state in `Cell`s, so the template is locked).
    reader: Mutex<RingReader>,
    cache: RwLock<RecentCache>,
    newest: AtomicU64,
    /// Oldest retained sequence (O), kept beside `newest` so subscribers can check it lock-free.
    /// A value of its own (nothing is published through it): Relaxed, as `corrupt_floor`.
    oldest: AtomicU64,
    /// Highest sequence number found corrupt in the ring (0: none). Fresh subscribers start above
    /// it, so that they do not all run into the same damaged record while it is retained.
    corrupt_floor: AtomicU64,
    /// The cache never holds more than this (a quarter of the ring), so everything it serves
    /// is also inside the ring's retained window.
    cache_max_bytes: usize,
    notify: tokio::sync::Notify,
    metrics: RingGauges,
    /// Set when the ring file can no longer be used (truncated under the writer): nothing may
    /// touch its mapping any more.
    failure: std::sync::OnceLock<String>,
    /// Sees every published source under the writer lock (the snapshot table).
    hook: std::sync::OnceLock<Arc<dyn PublishHook>>,
}

/// What one source became.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Records written.
    pub records: usize,
    /// Their total encoded size.
    pub bytes: usize,
    /// Sequence number of the last record written (0: none).
    pub last_seq: u64,
}

/// The writer's position in its ring: the retained window in records and in bytes.
///
/// `head` and `tail` are logical byte positions that only grow (the bytes the ring has written
/// since it was created, wrap padding included): the retained records are the bytes
/// `head .. tail`, and a record starting at byte `p` stays retained until `tail` passes
/// `p + capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingPosition {
    /// Oldest retained sequence number (O).
    pub oldest: u64,
    /// Newest committed sequence number (N).
    pub newest: u64,
    /// Logical byte position of the oldest retained record.
    pub head: u64,
    /// Logical byte position one past the newest record.
    pub tail: u64,
    /// Data capacity in bytes.
    pub capacity: u64,
}

impl RingPosition {
    /// Bytes retained (`tail − head`).
    pub fn used(&self) -> u64 {
        self.tail.saturating_sub(self.head)
    }
}

/// What a freshly opened hub found in its ring.
#[derive(Debug, Default, Clone)]
pub struct Recovered {
    /// The last engine batch held per rank (from record metadata): its engine sequence number and
    /// the digest of its bytes (0: not recorded), for replay catch-up and to tell a restarted
    /// engine from the one that published it.
    pub last_upstream: std::collections::HashMap<u32, (u64, u32)>,
    /// Whether an existing ring was adopted.
    pub adopted: bool,
    /// Records of an adopted ring that failed their checksum (skipped; never served).
    pub corrupt_records: u64,
    /// Why a file found at the path was replaced by a new ring instead of adopted.
    pub replaced: Option<Replaced>,
    /// The writer notes the ring holds (shm LAYOUT.md §3.1; empty for a new ring): what the
    /// last kvbridge on it learnt and cannot be derived from the records.
    pub notes: Vec<[u8; NOTE_LEN]>,
}

impl RingHub {
    /// Opens (adopting) or creates the ring at `path`. `label` names it in logs and metrics
    /// (`merged`, `rank-1`, …); only the merged ring feeds the record-size histogram.
    pub fn open(
        label: &str,
        path: &Path,
        opts: &WriterOptions,
        metrics: &RingMetrics,
    ) -> Result<(Arc<Self>, Recovered), RingError> {
        let err = |source| RingError::Open {
            path: path.display().to_string(),
            source,
        };
        let writer = RingWriter::open(path, opts).map_err(err)?;
        let reader = RingReader::open(path).map_err(err)?;
        let adopted = writer.adopted();
        let notes = writer.notes();
        let mut recovered = Recovered {
            adopted,
            replaced: writer.replaced().cloned(),
            notes: notes.clone(),
            ..Default::default()
        };
        match &recovered.replaced {
            Some(why) if why.is_damage() => tracing::warn!(ring = label, path = %path.display(),
                reason = %why,
                "the ring file found at start-up was unusable and has been replaced by a new ring \
                 (its retained history is lost: subscribers resume from 0): {why}"),
            Some(why) => tracing::info!(ring = label, path = %path.display(), reason = %why,
                "the ring file found at start-up was replaced by a new ring: {why}"),
            None => {}
        }
        let (next_event_id, corrupt_floor) = if adopted {
            recover(&reader, &mut recovered)
        } else {
            (1, 0)
        };
        if recovered.corrupt_records > 0 {
            tracing::warn!(ring = label, path = %path.display(), corrupt = recovered.corrupt_records,
                last_corrupt_seq = corrupt_floor,
                "adopted ring holds records that fail their checksum: they will not be served, and fresh subscribers start after them");
        }
        let newest = writer.newest();
        let oldest = writer.oldest();
        let capacity = writer.capacity();
        let cache_max_bytes = (capacity / 4).min(CACHE_MAX_BYTES);
        let hub = Arc::new(RingHub {
            label: label.to_string(),
            writer: Mutex::new(WriterState {
                writer,
                notes,
                next_event_id,
                published: Vec::new(),
            }),
            reader: Mutex::new(reader),
            cache: RwLock::new(RecentCache::default()),
            newest: AtomicU64::new(newest),
            oldest: AtomicU64::new(oldest),
            corrupt_floor: AtomicU64::new(corrupt_floor),
            cache_max_bytes,
            notify: tokio::sync::Notify::new(),
            metrics: RingGauges::new(metrics, label, capacity as u64, label == "merged"),
            failure: std::sync::OnceLock::new(),
            hook: std::sync::OnceLock::new(),
        });
        Ok((hub, recovered))
    }

    /// Name used in logs and metrics (`merged`, `rank-1`, …).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Publishes every record of `src`, numbered contiguously, with `dp_rank` in each record
    /// header and `meta` in each record's ring metadata.
    pub fn publish(
        &self,
        src: &dyn RecordSource,
        dp_rank: Option<i32>,
        meta: RecordMeta,
    ) -> Result<Published, RingError> {
        let mut out = Published::default();
        let mut st = self.writer.lock();
        let hook = self.hook.get();
        // (a publish that failed half-way returned with its records still listed)
        st.published.clear();
        for i in 0..src.records() {
            let hdr = RecordHeader {
                sequence_number: st.writer.next_seq(),
                first_event_id: st.next_event_id,
                dp_rank,
            };
            let len = src.record_len(i, &hdr);
            let mut slot = st.writer.reserve(len)?;
            let written = src.write_record(i, &hdr, slot.buf());
            debug_assert_eq!(written, len);
            let framed = cache::grpc_framed(&slot.buf()[..len]);
            let seq = slot.seq();
            slot.commit(meta);
            st.next_event_id += src.record_events(i);
            out.records += 1;
            out.bytes += len;
            out.last_seq = seq;
            if let Some(h) = &self.metrics.record_size {
                h.observe(len as f64);
            }
            if hook.is_some() {
                st.published.push(framed.slice(cache::GRPC_PREFIX_LEN..));
            }
            // Under the writer lock (see the module docs): cache first, then `newest`.
            self.cache
                .write()
                .push(seq, framed, meta.ingest_ns, self.cache_max_bytes);
            self.oldest.store(st.writer.oldest(), Ordering::Relaxed);
            // Release: pairs with the Acquire load in `newest()`, so that a reader who sees
            // `seq` finds it in the cache pushed just above.
            self.newest.store(seq, Ordering::Release);
        }
        if let Some(h) = hook {
            if out.records > 0 {
                h.published(src, &st.published, &meta, out.last_seq);
            }
            st.published.clear();
        }
        drop(st);
        if out.records > 0 {
            self.metrics.records.inc_by(out.records as u64);
            self.metrics.bytes.inc_by(out.bytes as u64);
            self.notify.notify_waiters();
        }
        Ok(out)
    }

    /// Edits the ring's writer notes with `edit` and writes them (crash-atomically, shm
    /// LAYOUT.md §3.1), under the writer lock; more than the header holds are cut, with an
    /// error logged.
    pub fn update_notes(
        &self,
        edit: impl FnOnce(&mut Vec<[u8; NOTE_LEN]>),
    ) -> Result<(), ShmError> {
        let mut st = self.writer.lock();
        let mut notes = st.notes.clone();
        edit(&mut notes);
        if notes == st.notes {
            return Ok(());
        }
        if notes.len() > NOTES_MAX {
            tracing::error!(ring = %self.label, notes = notes.len(), max = NOTES_MAX,
                "more writer notes than the ring header holds: the rest are not kept across a restart");
            notes.truncate(NOTES_MAX);
        }
        st.writer.set_notes(&notes)?;
        st.notes = notes;
        Ok(())
    }

    /// Installs the hook that sees every published source (once; later calls are ignored).
    pub fn set_hook(&self, hook: Arc<dyn PublishHook>) {
        let _ = self.hook.set(hook);
    }

    /// Keeps the writer's heartbeat fresh (readers report `WriterGone` when it goes stale), after
    /// checking that the ring file is still whole. An error means the ring is unusable: the hub
    /// is marked failed (see [`failure`](Self::failure)) and every waiter is woken.
    pub fn heartbeat(&self) -> Result<(), ShmError> {
        if self.failure.get().is_some() {
            return Ok(());
        }
        let r = self.writer.lock().writer.heartbeat();
        if let Err(e) = &r {
            let _ = self.failure.set(e.to_string());
            self.wake_all();
        }
        r
    }

    /// Why this ring can no longer be used (written or read), if it cannot.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// Where the writer is, in one consistent view (taken under the writer lock).
    pub fn position(&self) -> RingPosition {
        let st = self.writer.lock();
        let c = st.writer.cursor();
        RingPosition {
            oldest: st.writer.oldest(),
            newest: st.writer.newest(),
            head: c.head,
            tail: c.tail,
            capacity: st.writer.capacity() as u64,
        }
    }

    /// A new reader on this ring (shares the read-only mapping).
    pub fn reader(&self) -> RingReader {
        self.reader.lock().clone()
    }

    /// Newest committed sequence number (N).
    pub fn newest(&self) -> u64 {
        // Acquire: pairs with the Release store in `publish`, after the record entered the
        // cache.
        self.newest.load(Ordering::Acquire)
    }

    /// Oldest retained (O) and newest (N), one consistent view (taken under the writer lock).
    pub fn window(&self) -> (u64, u64) {
        let st = self.writer.lock();
        (st.writer.oldest(), st.writer.newest())
    }

    /// Oldest retained sequence (O), lock-free.
    pub fn oldest(&self) -> u64 {
        self.oldest.load(Ordering::Relaxed)
    }

    /// Counts an in-process reader (a subscriber) the writer overtook.
    pub fn count_reader_lap(&self) {
        self.metrics.reader_laps.inc();
    }

    /// Counts a record an in-process reader (a subscriber) found corrupt.
    pub fn count_corrupt_read(&self) {
        self.metrics.corrupt_records.inc();
    }

    /// Notes that record `seq` was found corrupt in the ring (a subscriber read it).
    pub fn note_corrupt(&self, seq: u64) {
        self.corrupt_floor.fetch_max(seq, Ordering::Relaxed);
    }

    /// The first sequence number a fresh subscriber can read without running into a record
    /// known to be corrupt: O, or one past the newest corrupt record if that is still retained.
    pub fn readable_from(&self, oldest: u64) -> u64 {
        oldest.max(self.corrupt_floor.load(Ordering::Relaxed).saturating_add(1))
    }

    /// Record `seq` as one gRPC message ([`grpc_framed`]) and its ingest time (Unix ns), if
    /// still in the recent cache.
    pub fn cached_at(&self, seq: u64) -> Option<(Bytes, u64)> {
        self.cache.read().get(seq)
    }

    /// Resolves when a record newer than `seq` may exist, or once `stop()` is true. No timer:
    /// whoever makes `stop()` true must call [`wake_all`](Self::wake_all) afterwards (shutdown
    /// and a ring failure do); `stop()` is checked after registering, so that wake is never
    /// missed. One wait costs a waiter-list entry and nothing else, which matters when every
    /// committed record wakes every live subscriber.
    pub async fn wait_newer_unless(&self, seq: u64, stop: impl Fn() -> bool) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.newest() > seq || stop() {
            return;
        }
        notified.await;
    }

    /// Wakes every in-process waiter (used at shutdown).
    pub fn wake_all(&self) {
        self.notify.notify_waiters();
    }
}

/// Walks an adopted ring: learns each rank's last upstream sequence (so that ingest can ask the
/// engine's replay for exactly what it missed) and returns the event id to continue from and the
/// newest corrupt record's sequence number (0: none); corrupt records are counted and skipped.
fn recover(reader: &RingReader, recovered: &mut Recovered) -> (u64, u64) {
    let mut next_event_id = 1;
    let mut corrupt_floor = 0;
    let mut r = reader.clone();
    let mut buf = Vec::new();
    loop {
        match r.next() {
            ReadOutcome::Record(v) => {
                let meta = v.meta();
                if !v.copy_to(&mut buf) {
                    continue;
                }
                if meta.flags & FLAG_SYNTHESIZED == 0 {
                    recovered
                        .last_upstream
                        .insert(meta.dp_rank, (meta.upstream_seq, meta.upstream_digest));
                }
                if let Ok(batch) = crate::proto::common::KvEventBatch::decode(buf.as_slice()) {
                    if let Some(max) = batch.events.iter().map(|e| e.event_id).max() {
                        next_event_id = next_event_id.max(max + 1);
                    }
                }
            }
            ReadOutcome::Lapped { .. } => continue,
            ReadOutcome::Corrupt { seq, .. } => {
                recovered.corrupt_records += 1;
                corrupt_floor = seq;
            }
            _ => break,
        }
    }
    (next_event_id, corrupt_floor)
}
