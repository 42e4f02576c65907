//! The service's side of the shared-memory ring (`kvbridge-shm`): one [`RingHub`] per ring file.
//!
//! The hub is where decoded batches become numbered records. It owns the ring's only writer
//! (behind a mutex, because every ingest rank publishes into the merged ring), assigns
//! `event_id`s, keeps the most recent records as shared [`Bytes`] so that live subscribers copy
//! nothing of their own, and wakes in-process subscribers after each commit. Readers in other
//! processes use the ring file directly and are woken by the ring's futex.
//!
//! Why a cache beside the ring: a record in shared memory can be overwritten while a reader
//! copies it, so every in-process subscriber would need its own validated copy. Copying once at
//! commit time into a reference-counted buffer lets thousands of live subscribers share it.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvbridge_shm::{ReadOutcome, RecordMeta, RingReader, RingWriter, ShmError, WriterOptions};
use parking_lot::{Mutex, RwLock};
use prost::Message;
use thiserror::Error;

use crate::decode::{self, BatchPlan, Decoder, RecordHeader};

/// Record flag: a batch kvbridge synthesized (an in-band clear), not an engine batch.
pub const FLAG_SYNTHESIZED: u32 = 1;

/// Why kvbridge inserted a `cleared` event (smg-api.md §6.4). Stored in record flags bits 8..16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearCause {
    /// The engine's sequence went back: a new incarnation with an empty cache.
    EngineRestart = 1,
    /// A gap with no replay endpoint, or one replay could not fill.
    UnfillableGap = 2,
    /// The engine's replay buffer no longer held the start of the gap.
    MissingHistory = 3,
    /// A batch that could not be decoded (or was empty) consumed a sequence number.
    Undecodable = 4,
    /// Live batches overflowed the buffer kept during a replay.
    ReplayOverflow = 5,
    /// A `BlockRemoved` could not be decoded: the index would keep a stale block.
    LostRemoval = 6,
}

impl ClearCause {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            ClearCause::EngineRestart => "engine_restart",
            ClearCause::UnfillableGap => "unfillable_gap",
            ClearCause::MissingHistory => "missing_history",
            ClearCause::Undecodable => "undecodable",
            ClearCause::ReplayOverflow => "replay_overflow",
            ClearCause::LostRemoval => "lost_removal",
        }
    }
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

/// Most recent records as shared bytes with their ingest time (Unix ns), indexed by sequence
/// number.
struct RecentCache {
    first_seq: u64,
    items: VecDeque<(Bytes, u64)>,
    bytes: usize,
}

const CACHE_MAX_ITEMS: usize = 8192;
const CACHE_MAX_BYTES: usize = 32 << 20;

impl RecentCache {
    #[cfg(test)]
    fn push(&mut self, seq: u64, b: Bytes, max_bytes: usize) {
        self.push_at(seq, b, 0, max_bytes)
    }
    fn push_at(&mut self, seq: u64, b: Bytes, ingest_ns: u64, max_bytes: usize) {
        if self.items.is_empty() || seq != self.first_seq + self.items.len() as u64 {
            self.items.clear();
            self.bytes = 0;
            self.first_seq = seq;
        }
        self.bytes += b.len();
        self.items.push_back((b, ingest_ns));
        while self.items.len() > CACHE_MAX_ITEMS || (self.bytes > max_bytes && self.items.len() > 1)
        {
            if let Some((old, _)) = self.items.pop_front() {
                self.bytes -= old.len();
                self.first_seq += 1;
            }
        }
    }
    fn get(&self, seq: u64) -> Option<Bytes> {
        self.get_at(seq).map(|(b, _)| b)
    }
    fn get_at(&self, seq: u64) -> Option<(Bytes, u64)> {
        let i = seq.checked_sub(self.first_seq)?;
        self.items.get(i as usize).cloned()
    }
}

struct WriterState {
    writer: RingWriter,
    next_event_id: u64,
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
    oldest: AtomicU64,
    /// The cache never holds more than this (a quarter of the ring), so everything it serves
    /// is also inside the ring's retained window.
    cache_max_bytes: usize,
    notify: tokio::sync::Notify,
}

/// What one engine batch became.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Records written.
    pub records: usize,
    /// Their total encoded size.
    pub bytes: usize,
}

/// What a freshly opened hub found in its ring.
#[derive(Debug, Default, Clone)]
pub struct Recovered {
    /// Last engine sequence number held per rank (from record metadata), for replay catch-up.
    pub last_upstream: std::collections::HashMap<u32, u64>,
    /// Whether an existing ring was adopted.
    pub adopted: bool,
}

impl RingHub {
    /// Opens (adopting) or creates the ring at `path`.
    pub fn open(
        label: &str,
        path: &Path,
        opts: &WriterOptions,
    ) -> Result<(Arc<Self>, Recovered), RingError> {
        let err = |source| RingError::Open {
            path: path.display().to_string(),
            source,
        };
        let writer = RingWriter::open(path, opts).map_err(err)?;
        let reader = RingReader::open(path).map_err(err)?;
        let adopted = writer.adopted();
        let mut recovered = Recovered {
            adopted,
            ..Default::default()
        };
        let mut next_event_id = 1;
        if adopted {
            // Continue event ids after the newest record, and learn each rank's last upstream
            // sequence so that ingest can ask the engine's replay for exactly what it missed.
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
                                .insert(meta.dp_rank, meta.upstream_seq);
                        }
                        if let Ok(batch) =
                            crate::proto::common::KvEventBatch::decode(buf.as_slice())
                        {
                            if let Some(max) = batch.events.iter().map(|e| e.event_id).max() {
                                next_event_id = next_event_id.max(max + 1);
                            }
                        }
                    }
                    ReadOutcome::Lapped { .. } => continue,
                    _ => break,
                }
            }
        }
        let newest = writer.newest();
        let oldest = writer.oldest();
        let cache_max_bytes = (writer.capacity() / 4).min(CACHE_MAX_BYTES);
        let hub = Arc::new(RingHub {
            label: label.to_string(),
            writer: Mutex::new(WriterState {
                writer,
                next_event_id,
            }),
            reader: Mutex::new(reader),
            cache: RwLock::new(RecentCache {
                first_seq: 0,
                items: VecDeque::new(),
                bytes: 0,
            }),
            newest: AtomicU64::new(newest),
            oldest: AtomicU64::new(oldest),
            cache_max_bytes,
            notify: tokio::sync::Notify::new(),
        });
        Ok((hub, recovered))
    }

    /// Name used in logs and metrics (`merged`, `rank-1`, …).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Publishes every record of a planned engine batch.
    pub fn publish_batch(
        &self,
        dec: &Decoder,
        plan: &BatchPlan,
        payload: &[u8],
        dp_rank: Option<i32>,
        meta: RecordMeta,
    ) -> Result<Published, RingError> {
        let mut out = Published::default();
        let mut st = self.writer.lock();
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: st.writer.next_seq(),
                first_event_id: st.next_event_id,
                dp_rank,
            };
            let len = dec.record_len(i, &hdr);
            let mut slot = st.writer.reserve(len)?;
            let written = dec.write_record(payload, i, &hdr, slot.buf());
            debug_assert_eq!(written, len);
            let shared = Bytes::copy_from_slice(&slot.buf()[..len]);
            let seq = slot.seq();
            slot.commit(meta);
            st.next_event_id += dec.record_events(i);
            out.records += 1;
            out.bytes += len;
            self.cache
                .write()
                .push_at(seq, shared, meta.ingest_ns, self.cache_max_bytes);
            self.oldest.store(st.writer.oldest(), Ordering::Release);
            self.newest.store(seq, Ordering::Release);
        }
        drop(st);
        if plan.records > 0 {
            self.notify.notify_waiters();
        }
        Ok(out)
    }

    /// Publishes a synthesized batch with one `cleared` event (engine restart, unfillable gap).
    pub fn publish_clear(
        &self,
        dp_rank: Option<i32>,
        rank: u32,
        upstream_seq: u64,
        cause: ClearCause,
    ) -> Result<u64, RingError> {
        let mut buf = Vec::with_capacity(32);
        let mut st = self.writer.lock();
        let hdr = RecordHeader {
            sequence_number: st.writer.next_seq(),
            first_event_id: st.next_event_id,
            dp_rank,
        };
        let len = decode::encode_cleared(&hdr, unix_seconds(), &mut buf);
        let mut slot = st.writer.reserve(len)?;
        slot.buf().copy_from_slice(&buf[..len]);
        let seq = slot.seq();
        let ingest_ns = unix_nanos();
        slot.commit(RecordMeta {
            dp_rank: rank,
            upstream_seq,
            flags: FLAG_SYNTHESIZED | ((cause as u32) << 8),
            ingest_ns,
        });
        st.next_event_id += 1;
        self.oldest.store(st.writer.oldest(), Ordering::Release);
        drop(st);
        buf.truncate(len);
        self.cache
            .write()
            .push_at(seq, Bytes::from(buf), ingest_ns, self.cache_max_bytes);
        self.newest.store(seq, Ordering::Release);
        self.notify.notify_waiters();
        Ok(seq)
    }

    /// Bytes of the ring's data area holding retained records (fill = this / capacity).
    pub fn used_bytes(&self) -> u64 {
        let c = self.writer.lock().writer.cursor();
        c.tail.saturating_sub(c.head)
    }

    /// Keeps the writer's heartbeat fresh (readers report `WriterGone` when it goes stale).
    pub fn heartbeat(&self) {
        self.writer.lock().writer.heartbeat();
    }

    /// A new reader on this ring (shares the read-only mapping).
    pub fn reader(&self) -> RingReader {
        self.reader.lock().clone()
    }

    /// Newest committed sequence number (N).
    pub fn newest(&self) -> u64 {
        self.newest.load(Ordering::Acquire)
    }

    /// Oldest retained (O) and newest (N), one consistent view (taken under the writer lock).
    pub fn window(&self) -> (u64, u64) {
        let st = self.writer.lock();
        (st.writer.oldest(), st.writer.newest())
    }

    /// Oldest retained sequence (O), lock-free.
    pub fn oldest(&self) -> u64 {
        self.oldest.load(Ordering::Acquire)
    }

    /// The encoded record `seq` if it is still in the recent cache.
    pub fn cached(&self, seq: u64) -> Option<Bytes> {
        self.cache.read().get(seq)
    }

    /// The encoded record `seq` and its ingest time (Unix ns), if still in the recent cache.
    pub fn cached_at(&self, seq: u64) -> Option<(Bytes, u64)> {
        self.cache.read().get_at(seq)
    }

    /// Resolves when a record newer than `seq` may exist (or after `max_wait`).
    pub async fn wait_newer(&self, seq: u64, max_wait: Duration) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.newest() > seq {
            return;
        }
        let _ = tokio::time::timeout(max_wait, notified).await;
    }

    /// Wakes every in-process waiter (used at shutdown).
    pub fn wake_all(&self) {
        self.notify.notify_waiters();
    }
}

/// Wall clock in seconds (timestamps of synthesized batches).
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Wall clock in nanoseconds (record ingest time).
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_indexes_by_seq_and_evicts() {
        let mut c = RecentCache {
            first_seq: 0,
            items: VecDeque::new(),
            bytes: 0,
        };
        for s in 10..10 + CACHE_MAX_ITEMS as u64 + 5 {
            c.push(s, Bytes::from(s.to_le_bytes().to_vec()), CACHE_MAX_BYTES);
        }
        assert!(c.get(10).is_none());
        assert_eq!(c.get(15).unwrap().as_ref(), &15u64.to_le_bytes());
        let last = 10 + CACHE_MAX_ITEMS as u64 + 4;
        assert_eq!(c.get(last).unwrap().as_ref(), &last.to_le_bytes());
        assert!(c.get(last + 1).is_none());
        // A discontinuity restarts the cache instead of mis-indexing.
        c.push(last + 10, Bytes::from_static(b"x"), CACHE_MAX_BYTES);
        assert!(c.get(last).is_none());
        assert_eq!(c.get(last + 10).unwrap().as_ref(), b"x");
    }
}
