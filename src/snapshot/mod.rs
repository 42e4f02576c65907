//! Snapshots for late joiners (docs/smg-api.md §3.5, §6.5): a live block table per ring, fed at
//! ingest, checkpointed beside the ring, and served as `KvSnapshotChunk` batches to a subscriber
//! starting from 0 once the ring no longer reaches back to the last clear.
//!
//! * `table.rs` — the table: what a gateway that followed the ring from the start holds.
//! * `image.rs` — its flat image, copied under the lock and read outside it.
//! * `serve.rs` — chunks from an image (parents first, `event_id` 0, numbered up to the cut).
//! * `persist.rs` — the checkpoint file beside the ring and the restore at start-up.
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
//! each new block's bytes) instead of being applied, and applied right after the copy. Ingest
//! waits only for that replay. Lock order everywhere: pending, then table.
//!
//! **Restart.** A checkpoint thread writes the image to `<ring>.snapshot` about once a second when the
//! table changed, and once more at shutdown. At start-up the table is the checkpoint plus the
//! ring records after its cut (SIGKILL loses nothing the ring still holds); a missing, damaged
//! or too old checkpoint gives a table rebuilt from the ring alone, marked incomplete
//! (`unknown_before = 1`) until the next clear.

mod image;
mod pending;
mod persist;
mod serve;
mod table;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts};

use crate::metrics::Metrics;
use crate::ring::{PublishHook, RecordSource, RingHub};
use kvbridge_shm::RecordMeta;

pub use persist::{checkpoint_path, read_checkpoint, CheckpointError, Restored};
pub use serve::{Chunks, CHUNK_MAX, CHUNK_MIN};
pub use table::{Table, COPIES_CAP};

/// When a subscriber starting from 0 gets a snapshot (`--snapshot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotMode {
    /// When the ring no longer reaches back to the last clear and the client set request
    /// field 2 (`load_records_before_first_batch`: it takes snapshot chunks; G2 gateways do).
    #[default]
    Auto,
    /// Every subscriber starting from 0, whatever the ring holds (operator's choice: G1 clients
    /// that disconnect mid-snapshot resume from a partial state).
    On,
    /// Never: the retained window, as without a table (no table is kept).
    Off,
}

/// Default `--snapshot-max-blocks`.
pub const DEFAULT_MAX_BLOCKS: usize = 4_000_000;

/// Snapshot settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotConfig {
    /// When snapshots are served.
    pub mode: SnapshotMode,
    /// Most blocks a table holds; beyond, snapshots are marked incomplete.
    pub max_blocks: usize,
    /// Largest snapshot chunk in bytes (below gRPC's 4 MiB default).
    pub chunk_bytes: usize,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        SnapshotConfig {
            mode: SnapshotMode::Auto,
            max_blocks: DEFAULT_MAX_BLOCKS,
            chunk_bytes: CHUNK_MAX,
        }
    }
}

/// Snapshot metrics (registered once per process).
pub struct SnapshotMetrics {
    blocks: IntGaugeVec,
    bytes: IntGaugeVec,
    unknown: IntGaugeVec,
    served: IntCounterVec,
    chunks: IntCounterVec,
    seconds: HistogramVec,
}

impl SnapshotMetrics {
    /// Registers the snapshot metrics on `m`'s registry.
    pub fn new(m: &Metrics) -> Arc<Self> {
        let reg = &m.registry;
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            let _ = reg.register(Box::new(g.clone()));
            g
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            let _ = reg.register(Box::new(c.clone()));
            c
        };
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "snapshot_serve_seconds",
                "time to build a snapshot (image copy under the lock + chunk encoding)",
            )
            .buckets(vec![0.0005, 0.002, 0.01, 0.05, 0.2, 1.0, 5.0]),
            &["ring"],
        )
        .expect("valid metric");
        let _ = reg.register(Box::new(seconds.clone()));
        Arc::new(SnapshotMetrics {
            blocks: gauge(
                "snapshot_table_blocks",
                "blocks held by the snapshot table, per ring and rank",
                &["ring", "rank"],
            ),
            bytes: gauge(
                "snapshot_table_bytes",
                "bytes held by the snapshot table, per ring",
                &["ring"],
            ),
            unknown: gauge(
                "snapshot_table_unknown",
                "events the table could not follow since the last clear (0 = complete)",
                &["ring"],
            ),
            served: counter(
                "snapshots_served_total",
                "snapshots served, per ring and completeness",
                &["ring", "complete"],
            ),
            chunks: counter(
                "snapshot_chunks_total",
                "snapshot chunks served, per ring",
                &["ring"],
            ),
            seconds,
        })
    }
}

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
    written_generation: Mutex<u64>,
    /// When the next checkpoint may be taken: copying the image takes a core (and ingest records aside meanwhile), so the interval
    /// grows with the copy time (≤ 5 % of ingest time, at least once a second).
    next_checkpoint: Mutex<Instant>,
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
            return;
        }
        self.table
            .lock()
            .apply(src, records, meta.dp_rank, last_seq);
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
        let generation = table.generation;
        let t = Arc::new(RingTable {
            label: hub.label().to_string(),
            table: Mutex::new(table),
            pending: Mutex::new(Pending::default()),
            copy: Mutex::new(()),
            checkpoint,
            dp_rank,
            chunk_bytes: cfg.chunk_bytes,
            written_generation: Mutex::new(generation),
            next_checkpoint: Mutex::new(Instant::now()),
            metrics,
        });
        hub.set_hook(t.clone());
        t.refresh_metrics();
        t
    }

    /// The ring's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Runs `f` on the table (under its lock: keep it short).
    pub fn with_table<R>(&self, f: impl FnOnce(&Table) -> R) -> R {
        f(&self.table.lock())
    }

    /// The table's image and its generation (a copy taken under the table lock, while ingest
    /// records what it publishes aside: see the module docs).
    fn image(&self) -> (Vec<u8>, u64) {
        self.image_then(|| {})
    }

    /// [`image`](Self::image), running `during` after the copy and before the recorded sources
    /// are applied (tests publish there).
    fn image_then(&self, during: impl FnOnce()) -> (Vec<u8>, u64) {
        let _one = self.copy.lock();
        self.pending.lock().copying = true;
        let (out, generation) = {
            let t = self.table.lock();
            let mut out = Vec::new();
            t.write_image(&mut out);
            (out, t.generation)
        };
        during();
        let mut p = self.pending.lock();
        let log = std::mem::take(&mut p.log);
        let mut t = self.table.lock();
        for s in &log {
            t.apply_with(s.rank, s.first, s.last, &mut |v| s.replay(v));
        }
        p.copying = false;
        (out, generation)
    }

    /// Builds a snapshot at the current cut; `None` when the cut is below the chunk count.
    pub fn snapshot(&self) -> Option<Chunks> {
        let t0 = Instant::now();
        let (img, _) = self.image();
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

    /// Writes the checkpoint if the table changed since the last one (and, unless `now`, if
    /// the interval since the last one has passed).
    pub fn checkpoint(&self, now: bool) -> std::io::Result<bool> {
        let mut written = self.written_generation.lock();
        if self.table.lock().generation == *written
            || (!now && Instant::now() < *self.next_checkpoint.lock())
        {
            return Ok(false);
        }
        let t0 = Instant::now();
        let (img, generation) = self.image();
        let held = t0.elapsed();
        *self.next_checkpoint.lock() = Instant::now() + (held * 20).max(Duration::from_secs(1));
        persist::write_checkpoint(&self.checkpoint, generation, &img)?;
        *written = generation;
        Ok(true)
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
/// `ring`, at its cut N; read the ring from N + 1 on. The checkpoint is at most about a second
/// old, and the ring must still hold N + 1 (else take it again).
pub fn from_checkpoint(ring: &Path) -> Result<Chunks, persist::CheckpointError> {
    let bytes = read_checkpoint(&checkpoint_path(ring))?;
    let img = image::Image::parse(&bytes)
        .map_err(|e| persist::CheckpointError::Damaged(e.to_string()))?;
    serve::build(&img, crate::clock::unix_seconds(), None, CHUNK_MAX)
        .ok_or_else(|| persist::CheckpointError::Damaged("cut below the chunk count".to_string()))
}

/// Writes each table's checkpoint when it changed, once a second or, for large tables, as
/// often as keeps the image copies (a core each) under 5 % of the time; refreshes the
/// gauges; at `stop` writes a last checkpoint.
pub fn spawn_checkpointer(
    tables: Vec<Arc<RingTable>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("kvbridge-snapshot".into())
        .spawn(move || {
            let mut last = Instant::now();
            loop {
                let stopping = stop.load(Ordering::SeqCst);
                if stopping || last.elapsed() >= Duration::from_secs(1) {
                    last = Instant::now();
                    for t in &tables {
                        if let Err(e) = t.checkpoint(stopping) {
                            tracing::warn!(ring = t.label(), path = %t.checkpoint.display(), error = %e,
                                "cannot write the snapshot checkpoint");
                        }
                        t.refresh_metrics();
                    }
                }
                if stopping {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
        .expect("spawn the checkpoint thread")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{DecodeConfig, Decoder};
    use crate::sim::{encode_batch, Layout, Workload};
    use kvbridge_shm::WriterOptions;

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

    /// An image copy lets ingest go on: what is published during the copy is not in the image
    /// (which is exactly the state at its cut) and not applied until after the copy; then the
    /// table is exactly what applying everything directly gives.
    #[test]
    fn sources_published_during_an_image_copy_are_applied_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Metrics::new();
        let opts = WriterOptions {
            capacity: 16 << 20,
            seq_base: Some(1),
            group_read: false,
        };
        let path = dir.path().join("ring");
        let (hub, _) = RingHub::open("merged", &path, &opts, &metrics).unwrap();
        let rt = RingTable::attach(
            &hub,
            &path,
            false,
            None,
            &SnapshotConfig::default(),
            SnapshotMetrics::new(&metrics),
        );
        let mut w = Workload::new(5);
        let payloads: Vec<Vec<u8>> = (0..600)
            .map(|n| encode_batch(Layout::Vllm0102, 1.7e9, &w.next_batch(), n))
            .collect();
        let mut dec = Decoder::new(DecodeConfig::default());
        // `reference` is fed every source directly, as the hook does without a copy running
        let mut reference = Table::new(usize::MAX, 1);
        let publish = |dec: &mut Decoder, reference: &mut Table, p: &[u8]| {
            let plan = dec.plan(p).expect("valid");
            let meta = RecordMeta {
                dp_rank: 0,
                upstream_seq: 1,
                flags: 0,
                ingest_ns: 1,
            };
            let out = hub.publish(&dec.planned(&plan, p), None, meta).unwrap();
            reference.apply(&dec.planned(&plan, p), &[], 0, out.last_seq);
        };
        for p in &payloads[..300] {
            publish(&mut dec, &mut reference, p);
        }
        let mut at_cut = Vec::new();
        reference.image(&mut at_cut);
        let cut = reference.cut();
        let (img, _) = rt.image_then(|| {
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
}
