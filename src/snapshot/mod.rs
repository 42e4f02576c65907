//! Snapshots for late joiners (docs/smg-api.md §3.5, §6.5): a live block table per ring, fed at
//! ingest, checkpointed beside the ring, and served as `KvSnapshotChunk` batches to a subscriber
//! starting from 0 once the ring no longer reaches back to the last clear.
//!
//! * `table.rs` — the table: what a gateway that followed the ring from the start holds.
//! * `image.rs` — its flat image, copied under the lock and read outside it.
//! * `serve.rs` — chunks from an image (parents first, `event_id` 0, numbered up to the cut).
//! * `persist.rs` — the checkpoint file beside the ring and the restore at start-up.
//! * `schedule.rs` — when the checkpoint is rewritten (before the ring laps its cut).
//! * `LAYOUT.md` — the checkpoint's byte layout.
//!
//! **The cut.** The ring calls [`RingTable`] (a [`PublishHook`]) under its writer lock after a
//! source's last record is committed, and the table records that record's number as its cut. A
//! snapshot copies the table's image under the table's own lock; the image therefore holds
//! exactly the events of records ≤ its cut, and the subscriber continues from the ring at
//! cut + 1: no gap, no duplicate, whatever ingest does meanwhile.
//!
//! **Copies do not hold ingest.** While an image is copied (for a snapshot or a checkpoint:
//! 131 ms at 1,000,000 blocks), what ingest publishes is recorded aside (`pending.rs`: a copy of
//! each new block's bytes) instead of being applied, and applied right after the copy, a few
//! sources per acquisition of the lock while ingest goes on recording (`DRAIN_SLICE`). Ingest
//! waits at most for one such slice. Lock order everywhere: pending, then table.
//!
//! **Restart.** A checkpoint thread writes the image to `<ring>.snapshot` before the ring laps
//! the last checkpoint's cut, otherwise at most every `--checkpoint-interval` when the table
//! changed, and once more at shutdown (`schedule.rs`; docs/checkpoints.md). At start-up the
//! table is the checkpoint plus the ring records after its cut (SIGKILL loses nothing the ring
//! still holds); a missing, damaged or too old checkpoint gives a table rebuilt from the ring
//! alone, marked incomplete (`unknown_before = 1`) until the next clear.

mod config;
mod image;
mod metrics;
mod pending;
mod persist;
mod schedule;
mod serve;
mod table;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::metrics::Metrics;
use crate::ring::{PublishHook, RecordSource, RingHub, RingSet};
use kvbridge_shm::RecordMeta;
use schedule::{OnDisk, Schedule};

pub use config::{SnapshotConfig, SnapshotMode, DEFAULT_MAX_BLOCKS};
use metrics::CheckpointGauges;
pub use metrics::SnapshotMetrics;
pub use persist::{checkpoint_path, read_checkpoint, CheckpointError, Restored};
pub use schedule::DEFAULT_CHECKPOINT_INTERVAL;
pub use serve::{Chunks, CHUNK_MAX, CHUNK_MIN};
pub use table::{Table, COPIES_CAP};

/// A table's state at its cut, as events ([`RingTable::state`]).
#[derive(Debug, Clone)]
pub struct TableState {
    /// The ring record the state includes, and every one before it.
    pub cut: u64,
    /// Non-zero: the table is incomplete (rebuilt from the ring alone, see the module docs).
    pub unknown_before: u64,
    /// Encoded `KvEventBatch` bodies holding only `events` (field 3): the first event is a
    /// `cleared`, then the stores, parents first (every block after its parent, where the table
    /// holds the parent), then one single-block store per further physical copy.
    pub events: Vec<Vec<u8>>,
}

/// The checkpoint thread's state of one table.
struct Checkpointing {
    schedule: Schedule,
    /// The last write failed (logged once per failure streak; retried after [`RETRY`]).
    failing: Option<Instant>,
    /// The ring lapped the checkpoint on disk (logged once until a checkpoint is written).
    lapped: bool,
}

/// Recorded sources applied per acquisition of the table lock after an image copy (what ingest
/// can wait for: each is one published source, applied as ingest applies it).
const DRAIN_SLICE: usize = 8;

/// Least wait before a failed checkpoint write is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Longest the checkpoint thread sleeps: it refreshes the gauges this often; the ring's lap
/// wakes it sooner (a publication crossing [`Schedule::wake_at`]).
const TICK: Duration = Duration::from_millis(250);

/// The table of one ring, its checkpoint file and the ring's `dp_rank` for chunks.
pub struct RingTable {
    label: String,
    table: Mutex<Table>,
    /// Whether an image is being copied, and what was published meanwhile (taken before
    /// `table`; held by the hook while it applies, so a copy starts between two sources).
    pending: Mutex<Pending>,
    /// One image copy at a time.
    copy: Mutex<()>,
    checkpoint: PathBuf,
    dp_rank: Option<i32>,
    chunk_bytes: usize,
    /// The ring (weak: the ring holds this table as its hook).
    hub: Weak<RingHub>,
    /// When to write the checkpoint (the checkpoint thread's; never taken by ingest).
    checkpointing: Mutex<Checkpointing>,
    /// A publication of this sequence number or later wakes the checkpoint thread: the ring is
    /// about to lap the checkpoint's cut (`u64::MAX`: none).
    wake_at: AtomicU64,
    /// The checkpoint thread, to wake.
    waker: OnceLock<std::thread::Thread>,
    gauges: CheckpointGauges,
    metrics: Arc<SnapshotMetrics>,
}

/// See [`RingTable::pending`].
#[derive(Default)]
struct Pending {
    copying: bool,
    log: Vec<pending::Logged>,
}

impl PublishHook for RingTable {
    fn published(
        &self,
        src: &dyn RecordSource,
        records: &[Bytes],
        meta: &RecordMeta,
        last_seq: u64,
    ) {
        let mut p = self.pending.lock();
        if p.copying {
            p.log.push(pending::Logged::record(
                src,
                records,
                meta.dp_rank,
                last_seq,
            ));
        } else {
            self.table
                .lock()
                .apply(src, records, meta.dp_rank, last_seq);
        }
        drop(p);
        if last_seq >= self.wake_at.load(Ordering::Relaxed) {
            self.wake_at.store(u64::MAX, Ordering::Relaxed);
            if let Some(t) = self.waker.get() {
                t.unpark();
            }
        }
    }
}

impl RingTable {
    /// Restores the table of `hub` (ring file `path`; `adopted` when the ring existed) and
    /// installs it as the hub's publish hook. Call before anything publishes.
    pub fn attach(
        hub: &Arc<RingHub>,
        path: &Path,
        adopted: bool,
        dp_rank: Option<i32>,
        ranks: &[u32],
        cfg: &SnapshotConfig,
        metrics: Arc<SnapshotMetrics>,
    ) -> Arc<Self> {
        let checkpoint = checkpoint_path(path);
        let (table, restored) = persist::restore(
            &checkpoint,
            &hub.reader(),
            adopted,
            hub.window(),
            cfg.max_blocks,
        );
        match &restored {
            Restored::Ring { why } if adopted => tracing::warn!(ring = hub.label(),
                blocks = table.len(), reason = %why,
                "snapshot table rebuilt from the ring alone: snapshots are marked incomplete until the next clear"),
            r => {
                tracing::info!(ring = hub.label(), blocks = table.len(), restored = ?r, "snapshot table ready")
            }
        }
        // A checkpoint that is exactly the table: its cut is the ring's newest record, so record
        // cut + 1 will start at the ring's tail. Any other start writes one at once.
        let disk = match restored {
            Restored::Checkpoint { cut, records: 0 } => Some(OnDisk {
                cut,
                generation: table.generation,
                start: hub.position().tail,
                at: file_time(&checkpoint),
            }),
            _ => None,
        };
        let t = Arc::new(RingTable {
            label: hub.label().to_string(),
            table: Mutex::new(table),
            pending: Mutex::new(Pending::default()),
            copy: Mutex::new(()),
            checkpoint,
            dp_rank,
            chunk_bytes: cfg.chunk_bytes,
            hub: Arc::downgrade(hub),
            checkpointing: Mutex::new(Checkpointing {
                schedule: Schedule::new(cfg.checkpoint_interval, disk),
                failing: None,
                lapped: false,
            }),
            wake_at: AtomicU64::new(u64::MAX),
            waker: OnceLock::new(),
            gauges: CheckpointGauges::new(&metrics, hub.label()),
            metrics,
        });
        hub.set_hook(t.clone());
        // the start-up checkpoint is written before anything publishes (before the engine's
        // replay can lap the cut of the file found on disk)
        t.checkpoint_tick(false);
        t.series_at_zero(ranks);
        t.refresh_metrics();
        t
    }

    /// Every series of this ring's table at 0 before the first block or snapshot, so that a
    /// dashboard shows 0 and a rate is defined (`ranks`: the engine ranks the ring carries).
    fn series_at_zero(&self, ranks: &[u32]) {
        let (m, ring) = (&self.metrics, self.label.as_str());
        for r in ranks {
            m.blocks.with_label_values(&[ring, &r.to_string()]);
        }
        for complete in ["true", "false"] {
            m.served.with_label_values(&[ring, complete]);
        }
        m.chunks.with_label_values(&[ring]);
        m.seconds.with_label_values(&[ring]);
    }

    /// The ring's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Runs `f` on the table (under its lock: keep it short).
    pub fn with_table<R>(&self, f: impl FnOnce(&Table) -> R) -> R {
        f(&self.table.lock())
    }

    /// The table's image, its generation and its cut (a copy taken under the table lock, while
    /// ingest records what it publishes aside: see the module docs).
    fn image(&self) -> (Vec<u8>, u64, u64) {
        self.image_then(|| {})
    }

    /// [`image`](Self::image), running `during` after the copy and before the recorded sources
    /// are applied (tests publish there).
    fn image_then(&self, during: impl FnOnce()) -> (Vec<u8>, u64, u64) {
        let _one = self.copy.lock();
        self.pending.lock().copying = true;
        let (out, generation, cut) = {
            let t = self.table.lock();
            let mut out = Vec::new();
            t.write_image(&mut out);
            (out, t.generation, t.cut)
        };
        during();
        self.drain_pending(DRAIN_SLICE, &mut || {});
        (out, generation, cut)
    }

    /// Applies what was recorded during a copy, at most `slice` sources per acquisition of the
    /// table lock, and ends the copy (ingest applies directly again). The pending lock is held
    /// only to take a slice out of the log, and through the last slice (so that no source is
    /// recorded after it and none applied before it): ingest waits at most for one slice, not
    /// for everything published during the copy (350–400 sources, ≈ 1 ms after a 1,000,000-block
    /// copy at 2,000 batches/s; more with a slower copy). Ingest records while the slices are
    /// applied, so the log shrinks only as fast as the table applies faster than ingest
    /// publishes: applying is the work ingest itself does per source, so it does.
    /// `between` runs after each slice but the last, with no lock held (tests publish there).
    fn drain_pending(&self, slice: usize, between: &mut dyn FnMut()) {
        let slice = slice.max(1);
        loop {
            let mut p = self.pending.lock();
            if p.log.len() <= slice {
                let log = std::mem::take(&mut p.log);
                let mut t = self.table.lock();
                for s in &log {
                    t.apply_with(s.rank, s.first, s.last, &mut |v| s.replay(v));
                }
                p.copying = false;
                return;
            }
            let part: Vec<pending::Logged> = p.log.drain(..slice).collect();
            drop(p);
            let mut t = self.table.lock();
            for s in &part {
                t.apply_with(s.rank, s.first, s.last, &mut |v| s.replay(v));
            }
            drop(t);
            between();
        }
    }

    /// Builds a snapshot at the current cut; `None` when the cut is below the chunk count.
    pub fn snapshot(&self) -> Option<Chunks> {
        let t0 = Instant::now();
        let (img, _, _) = self.image();
        let parsed = image::Image::parse(&img).expect("an image written in this process");
        let chunks = serve::build(
            &parsed,
            crate::clock::unix_seconds(),
            self.dp_rank,
            self.chunk_bytes,
        )?;
        let m = &self.metrics;
        m.seconds
            .with_label_values(&[&self.label])
            .observe(t0.elapsed().as_secs_f64());
        m.served
            .with_label_values(&[
                self.label.as_str(),
                if chunks.unknown_before == 0 {
                    "true"
                } else {
                    "false"
                },
            ])
            .inc();
        m.chunks
            .with_label_values(&[&self.label])
            .inc_by(chunks.chunks.len() as u64);
        Some(chunks)
    }

    /// The table at its cut as a state to rebuild from nothing, for an edge that numbers and
    /// frames it its own way (the engine wire's snapshot service): see [`TableState`].
    pub fn state(&self) -> TableState {
        let (img, _, _) = self.image();
        let parsed = image::Image::parse(&img).expect("an image written in this process");
        TableState {
            cut: parsed.cut,
            unknown_before: parsed.unknown,
            events: serve::bodies(&parsed, self.chunk_bytes),
        }
    }

    /// The checkpoint thread's turn (see `schedule.rs`): writes the checkpoint when one is due
    /// (`stopping`: the last one, if the table changed), updates the checkpoint gauges and sets
    /// the publication that wakes the thread next. Returns how long the thread may sleep.
    pub fn checkpoint_tick(&self, stopping: bool) -> Duration {
        let Some(hub) = self.hub.upgrade() else {
            return TICK;
        };
        let mut c = self.checkpointing.lock();
        let now = Instant::now();
        let pos = hub.position();
        c.schedule.observe(now, &pos);
        let generation = self.table.lock().generation;
        let retry = c.failing.is_some_and(|t| now < t + RETRY) && !stopping;
        if let Some(reason) = c
            .schedule
            .due(now, &pos, generation, stopping)
            .filter(|_| !retry)
        {
            match self.write_checkpoint(&hub) {
                Ok((disk, bytes)) => {
                    let took = disk.at.elapsed();
                    c.schedule.written(disk, took);
                    let g = &self.gauges;
                    g.seconds.observe(took.as_secs_f64());
                    g.bytes.inc_by(bytes);
                    self.metrics
                        .checkpoints
                        .with_label_values(&[self.label.as_str(), reason.label()])
                        .inc();
                    if c.failing.take().is_some() {
                        tracing::info!(ring = self.label, path = %self.checkpoint.display(),
                            "snapshot checkpoint written again");
                    }
                    c.lapped = false;
                }
                Err(e) => {
                    self.gauges.errors.inc();
                    if c.failing.replace(now).is_none() {
                        tracing::warn!(ring = self.label, path = %self.checkpoint.display(), error = %e,
                            "cannot write the snapshot checkpoint (retrying; a restart meanwhile may rebuild the table incomplete)");
                    }
                }
            }
        }
        let pos = hub.position();
        let g = &self.gauges;
        let margin = c.schedule.margin(&pos);
        g.margin.set(margin.unwrap_or(0));
        g.rate.set(c.schedule.rate());
        g.age.set(
            c.schedule
                .disk
                .map_or(0.0, |d| d.at.elapsed().as_secs_f64()),
        );
        if margin.is_some_and(|m| m < 0) && !c.lapped {
            c.lapped = true;
            g.lapped.inc();
            tracing::warn!(ring = self.label, capacity = pos.capacity, write_rate = c.schedule.rate(),
                "the ring lapped the snapshot checkpoint's cut: a restart now would rebuild the table incomplete (a larger --ring-size keeps it)");
        }
        let s = &c.schedule;
        self.wake_at.store(s.wake_at(&pos), Ordering::Relaxed);
        // a publication may have passed the new mark before it was set: look again soon then
        let sleep = if hub.newest() >= self.wake_at.load(Ordering::Relaxed) {
            Duration::from_millis(1)
        } else {
            TICK
        };
        let sleep = s.recheck(now, &pos).map_or(sleep, |d| d.min(sleep));
        if c.failing.is_some() {
            sleep.max(RETRY / 4)
        } else {
            sleep
        }
    }

    /// Writes the checkpoint now: what is on disk afterwards, and the file's size.
    fn write_checkpoint(&self, hub: &RingHub) -> std::io::Result<(OnDisk, u64)> {
        let at = Instant::now();
        // read before the copy: record cut + 1 starts here or later (a margin on the safe side)
        let start = hub.position().tail;
        let (img, generation, cut) = self.image();
        persist::write_checkpoint(&self.checkpoint, generation, &img)?;
        let disk = OnDisk {
            cut,
            generation,
            start,
            at,
        };
        Ok((disk, (persist::HEADER_LEN + img.len()) as u64))
    }

    /// Updates the table gauges.
    pub fn refresh_metrics(&self) {
        let (per_rank, bytes, unknown) =
            self.with_table(|t| (t.per_rank().to_vec(), t.bytes() as i64, t.unknown() as i64));
        let m = &self.metrics;
        for (r, n) in per_rank.iter().enumerate() {
            m.blocks
                .with_label_values(&[&self.label, &r.to_string()])
                .set(*n as i64);
        }
        m.bytes.with_label_values(&[&self.label]).set(bytes);
        m.unknown.with_label_values(&[&self.label]).set(unknown);
    }
}

/// The tables of a bridge's rings and when to serve them.
pub struct Snapshots {
    mode: SnapshotMode,
    tables: HashMap<String, Arc<RingTable>>,
}

impl Snapshots {
    /// Snapshots served in `mode` from `tables`.
    pub fn new(mode: SnapshotMode, tables: Vec<Arc<RingTable>>) -> Self {
        Snapshots {
            mode,
            tables: tables.into_iter().map(|t| (t.label.clone(), t)).collect(),
        }
    }

    /// The table of the ring labelled `label`.
    pub fn table(&self, label: &str) -> Option<&Arc<RingTable>> {
        self.tables.get(label)
    }

    /// For a subscriber starting at `start` on `hub` (`takes_chunks`: request field 2 set), the
    /// snapshot to send first, or `None` for the retained window.
    pub fn for_subscriber(&self, hub: &RingHub, start: u64, takes_chunks: bool) -> Option<Chunks> {
        if start != 0 {
            return None;
        }
        let t = self.tables.get(hub.label())?;
        match self.mode {
            SnapshotMode::Off => None,
            SnapshotMode::On => t.snapshot(),
            SnapshotMode::Auto => {
                let origin = t.with_table(|t| t.origin());
                (takes_chunks && hub.oldest() > origin).then(|| t.snapshot())?
            }
        }
    }

    /// Every table.
    pub fn tables(&self) -> impl Iterator<Item = &Arc<RingTable>> {
        self.tables.values()
    }
}

/// A local reader's snapshot (no socket): the chunks of the checkpoint beside the ring at
/// `ring`, at its cut N; read the ring from N + 1 on. The checkpoint is at most
/// `--checkpoint-interval` old when the table changed (the ring then holds the rest), and the
/// bridge rewrites it before the ring laps N + 1; a reader that finds N + 1 gone takes it again.
pub fn from_checkpoint(ring: &Path) -> Result<Chunks, persist::CheckpointError> {
    let bytes = read_checkpoint(&checkpoint_path(ring))?;
    let img = image::Image::parse(&bytes)
        .map_err(|e| persist::CheckpointError::Damaged(e.to_string()))?;
    serve::build(&img, crate::clock::unix_seconds(), None, CHUNK_MAX)
        .ok_or_else(|| persist::CheckpointError::Damaged("cut below the chunk count".to_string()))
}

/// When the checkpoint at `path` was written, as an `Instant` (now, if unknown).
fn file_time(path: &Path) -> Instant {
    let now = Instant::now();
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .and_then(|age| now.checked_sub(age))
        .unwrap_or(now)
}

/// The running snapshot edge: one table per ring, and the thread that checkpoints them.
pub struct SnapshotEdge {
    tables: Vec<Arc<RingTable>>,
    checkpointer: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

/// Starts the edge for `rings`: one table per ring (none with `--snapshot off`), each restored
/// from its checkpoint and installed as its ring's publish hook, and the checkpoint thread.
/// Call before anything publishes, so that the tables see every record.
pub fn start(cfg: &SnapshotConfig, rings: &RingSet, metrics: &Metrics) -> SnapshotEdge {
    if cfg.mode == SnapshotMode::Off {
        return SnapshotEdge {
            tables: Vec::new(),
            checkpointer: None,
        };
    }
    let m = SnapshotMetrics::new(metrics);
    let merged = RingTable::attach(
        &rings.merged,
        rings.path(),
        rings.recovered.adopted,
        None,
        &rings.ingest_ranks,
        cfg,
        m.clone(),
    );
    let mut tables = vec![merged];
    for (r, hub) in rings.rank_hubs.iter().enumerate() {
        let rank = r as u32;
        let adopted = rings.rank_adopted.get(r).copied().unwrap_or(false);
        let files = rings.rank_files(rank);
        tables.push(RingTable::attach(
            hub,
            files.path(),
            adopted,
            Some(rank as i32),
            &[rank],
            cfg,
            m.clone(),
        ));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let thread = spawn_checkpointer(tables.clone(), stop.clone());
    SnapshotEdge {
        tables,
        checkpointer: Some((stop, thread)),
    }
}

impl SnapshotEdge {
    /// The tables, the merged ring's first.
    pub fn tables(&self) -> &[Arc<RingTable>] {
        &self.tables
    }

    /// The snapshots served in `mode` from these tables.
    pub fn snapshots(&self, mode: SnapshotMode) -> Snapshots {
        Snapshots::new(mode, self.tables.clone())
    }

    /// Stops the checkpoint thread after it wrote a last checkpoint of every table that changed.
    /// Call after ingest stopped, so that the last checkpoint holds everything ingested.
    pub fn shutdown(self) {
        if let Some((stop, thread)) = self.checkpointer {
            stop.store(true, Ordering::Relaxed);
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

/// Writes each table's checkpoint when it is due (`schedule.rs`: before the ring laps the last
/// one's cut, at most every `--checkpoint-interval` otherwise, never when nothing changed) and
/// refreshes the gauges; at `stop` (unpark the thread after setting it) writes a last checkpoint
/// of each table that changed.
fn spawn_checkpointer(
    tables: Vec<Arc<RingTable>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("kvbridge-snapshot".into())
        .spawn(move || {
            for t in &tables {
                let _ = t.waker.set(std::thread::current());
            }
            loop {
                let stopping = stop.load(Ordering::Relaxed);
                let mut sleep = TICK;
                for t in &tables {
                    sleep = sleep.min(t.checkpoint_tick(stopping));
                    t.refresh_metrics();
                }
                if stopping {
                    break;
                }
                std::thread::park_timeout(sleep);
            }
        })
        .expect("spawn the checkpoint thread")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{DecodeConfig, Decoder};
    use kvbridge_shm::WriterOptions;
    use kvbridge_tools::sim::{encode_batch, Layout, Workload};

    /// An image's content, independent of the map's order and of attribute ids.
    type Canon = (
        u64,
        u64,
        u64,
        Vec<(i64, u8, u8, u16, Option<i64>, Vec<u8>, Vec<u8>)>,
    );

    fn canon(img: &[u8]) -> Canon {
        let i = image::Image::parse(img).expect("valid image");
        let mut blocks: Vec<_> = i
            .blocks
            .iter()
            .map(|b| {
                let attrs = i.attrs[b.attrs as usize].expect("used set").to_vec();
                (
                    b.hash,
                    b.class,
                    b.copies,
                    b.rank,
                    b.parent,
                    attrs,
                    b.block.to_vec(),
                )
            })
            .collect();
        blocks.sort();
        (i.cut, i.origin, i.unknown, blocks)
    }

    /// Publishes engine payload `p` into `hub` (the table sees it through its hook) and applies
    /// it to `reference` directly, as the hook does when no copy runs.
    fn publish_with_reference(hub: &RingHub, dec: &mut Decoder, reference: &mut Table, p: &[u8]) {
        let plan = dec.plan(p).expect("valid");
        let meta = RecordMeta {
            dp_rank: 0,
            upstream_seq: 1,
            flags: 0,
            ingest_ns: 1,
            upstream_digest: 0,
        };
        let out = hub.publish(&dec.planned(&plan, p), None, meta).unwrap();
        reference.apply(&dec.planned(&plan, p), &[], 0, out.last_seq);
    }

    /// A new 16 MiB ring in a temporary folder (kept while the result lives) with its table
    /// attached as its publish hook.
    fn fresh_table() -> (tempfile::TempDir, Arc<RingHub>, Arc<RingTable>) {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Metrics::new();
        let opts = WriterOptions {
            capacity: 16 << 20,
            seq_base: Some(1),
            group_read: false,
        };
        let path = dir.path().join("ring");
        let (hub, _) = RingHub::open(
            "merged",
            &path,
            &opts,
            &crate::ring::RingMetrics::new(&metrics),
        )
        .unwrap();
        let rt = RingTable::attach(
            &hub,
            &path,
            false,
            None,
            &[0],
            &SnapshotConfig::default(),
            SnapshotMetrics::new(&metrics),
        );
        (dir, hub, rt)
    }

    /// An image copy lets ingest go on: what is published during the copy is not in the image
    /// (which is exactly the state at its cut) and not applied until after the copy; then the
    /// table is exactly what applying everything directly gives.
    #[test]
    fn sources_published_during_an_image_copy_are_applied_after_it() {
        let (_dir, hub, rt) = fresh_table();
        let mut w = Workload::new(5);
        let payloads: Vec<Vec<u8>> = (0..600)
            .map(|n| encode_batch(Layout::Vllm0102, 1.7e9, &w.next_batch(), n))
            .collect();
        let mut dec = Decoder::new(DecodeConfig::default());
        // `reference` is fed every source directly, as the hook does without a copy running
        let mut reference = Table::new(usize::MAX, 1);
        let publish = |dec: &mut Decoder, reference: &mut Table, p: &[u8]| {
            publish_with_reference(&hub, dec, reference, p)
        };
        for p in &payloads[..300] {
            publish(&mut dec, &mut reference, p);
        }
        let mut at_cut = Vec::new();
        reference.image(&mut at_cut);
        let cut = reference.cut();
        let (img, _, _) = rt.image_then(|| {
            for p in &payloads[300..] {
                publish(&mut dec, &mut reference, p);
            }
            assert_eq!(
                rt.with_table(|t| t.cut()),
                cut,
                "nothing is applied while the copy runs"
            );
        });
        assert!(reference.cut() > cut);
        assert_eq!(
            canon(&img),
            canon(&at_cut),
            "the image is the state at its cut"
        );
        let mut after = Vec::new();
        reference.image(&mut after);
        let mut now = Vec::new();
        rt.with_table(|t| t.image(&mut now));
        let (now, after) = (canon(&now), canon(&after));
        assert!(now.3.len() > 100, "a real state ({} blocks)", now.3.len());
        assert_eq!(now, after, "recorded sources applied after the copy");
        assert!(rt.pending.lock().log.is_empty());
    }

    /// What was recorded during a copy is applied in slices while ingest goes on publishing
    /// (and recording) between them: the table ends exactly as if every source had been
    /// applied directly, in order, and ingest applies directly again afterwards.
    #[test]
    fn recorded_sources_applied_in_slices_while_ingest_publishes_equal_direct_application() {
        let (_dir, hub, rt) = fresh_table();
        let mut w = Workload::new(9);
        let payloads: Vec<Vec<u8>> = (0..900)
            .map(|n| encode_batch(Layout::Vllm0102, 1.7e9, &w.next_batch(), n))
            .collect();
        let dec = std::cell::RefCell::new(Decoder::new(DecodeConfig::default()));
        let reference = std::cell::RefCell::new(Table::new(usize::MAX, 1));
        let publish = |p: &[u8]| {
            publish_with_reference(&hub, &mut dec.borrow_mut(), &mut reference.borrow_mut(), p)
        };
        for p in &payloads[..300] {
            publish(p);
        }
        // a copy in progress: what is published now is recorded
        rt.pending.lock().copying = true;
        for p in &payloads[300..500] {
            publish(p);
        }
        assert_eq!(rt.pending.lock().log.len(), 200);
        let (mut next, mut slices) = (500, 0);
        let cut_before = rt.with_table(|t| t.cut());
        rt.drain_pending(7, &mut || {
            slices += 1;
            // two sources published per slice applied: the log still shrinks
            for p in payloads.get(next..(next + 2).min(900)).unwrap_or(&[]) {
                publish(p);
            }
            next = (next + 2).min(900);
            let (cut, logged) = (rt.with_table(|t| t.cut()), rt.pending.lock().log.len());
            assert!(cut > cut_before, "slices are applied one by one");
            assert!(logged > 0, "what ingest published meanwhile is recorded");
        });
        assert!(slices > 20, "applied in {slices} slices");
        assert!(!rt.pending.lock().copying);
        assert!(rt.pending.lock().log.is_empty());
        for p in &payloads[next..] {
            publish(p);
        }
        let (mut now, mut direct) = (Vec::new(), Vec::new());
        rt.with_table(|t| t.image(&mut now));
        reference.borrow().image(&mut direct);
        let (now, direct) = (canon(&now), canon(&direct));
        assert!(now.3.len() > 100, "a real state ({} blocks)", now.3.len());
        assert_eq!(now.0, hub.newest(), "the cut is the ring's newest record");
        assert_eq!(
            now, direct,
            "the same table as applying every source directly"
        );
    }
}
