//! The table's checkpoint beside the ring (`<ring>.snapshot`, LAYOUT.md §1) and the restore at
//! start-up: checkpoint + the ring records after its cut.
//!
//! Crash safety: a checkpoint is written whole to `<ring>.snapshot.tmp.<pid>` and renamed over
//! the old one, so a reader sees the old file or the new one, never a mix; a process killed while
//! writing leaves only a temporary file (removed at the next start). The header still carries a
//! CRC32C of header and image and the lengths, so that a file damaged any other way (truncated,
//! bytes changed) is detected: the table then starts from the ring alone and is marked
//! incomplete — a snapshot is never built from a damaged checkpoint.
use std::path::{Path, PathBuf};

use kvbridge_shm::{ReadOutcome, RingReader};
use prost::Message;

use super::image::Image;
use super::table::Table;
use crate::proto::common::{kv_cache_event, KvBlocksStored, KvEventBatch};
use crate::ring::{remove_tmps_of, tmp_of, EventVisitor, RingFiles, StoredEvent};

/// File magic (LAYOUT.md §1).
pub(crate) const MAGIC: [u8; 8] = *b"KVBSNAP\x01";
/// Header bytes.
pub(crate) const HEADER_LEN: usize = 32;

/// The checkpoint path of the ring at `ring` ([`RingFiles::checkpoint`], where every file
/// beside a ring is named and removed).
pub fn checkpoint_path(ring: &Path) -> PathBuf {
    RingFiles::new(ring).checkpoint()
}

/// Why a checkpoint was not used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// None written yet.
    #[error("no checkpoint")]
    Missing,
    /// Unreadable.
    #[error("cannot read the checkpoint: {0}")]
    Io(#[from] std::io::Error),
    /// Not a checkpoint, or damaged (torn, truncated, changed).
    #[error("damaged checkpoint: {0}")]
    Damaged(String),
}

/// Writes `image` as the checkpoint at `path` (atomically: temporary file, then rename).
pub(crate) fn write_checkpoint(path: &Path, generation: u64, image: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER_LEN + image.len());
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&generation.to_le_bytes());
    buf.extend_from_slice(&(image.len() as u64).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&buf[..24]), image);
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(&[0u8; 4]);
    debug_assert_eq!(buf.len(), HEADER_LEN);
    buf.extend_from_slice(image);
    let tmp = tmp_of(path);
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&buf)?;
    }
    std::fs::rename(&tmp, path)
}

/// Reads and checks the checkpoint at `path`: its image bytes.
pub fn read_checkpoint(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let buf = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(CheckpointError::Missing),
        Err(e) => return Err(e.into()),
    };
    let bad = |m: &str| CheckpointError::Damaged(m.to_string());
    if buf.len() < HEADER_LEN {
        return Err(bad("shorter than its header"));
    }
    if buf[..8] != MAGIC {
        return Err(bad("wrong magic"));
    }
    let len = u64::from_le_bytes(buf[16..24].try_into().expect("8")) as usize;
    if buf.len() - HEADER_LEN != len {
        return Err(bad(&format!(
            "image of {} bytes, header says {len}",
            buf.len() - HEADER_LEN
        )));
    }
    let want = u32::from_le_bytes(buf[24..28].try_into().expect("4"));
    let image = &buf[HEADER_LEN..];
    if crc32c::crc32c_append(crc32c::crc32c(&buf[..24]), image) != want {
        return Err(bad("checksum mismatch"));
    }
    Ok(image.to_vec())
}

/// How a table was restored at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// A brand-new ring: an empty, complete table.
    Fresh,
    /// From the checkpoint taken at `cut`, then `records` ring records after it.
    Checkpoint {
        /// The checkpoint's cut.
        cut: u64,
        /// Ring records applied after it.
        records: u64,
    },
    /// From the ring's retained records alone (`why` the checkpoint was not used): complete
    /// only if a clear was among them.
    Ring {
        /// Why the checkpoint was not used.
        why: String,
    },
}

/// Restores the table of a ring holding [o, n] (`adopted`: an existing ring): from its
/// checkpoint when the ring still holds every record after the checkpoint's cut, else from the
/// ring alone, marked incomplete unless the ring holds a clear.
pub(crate) fn restore(
    path: &Path,
    reader: &RingReader,
    adopted: bool,
    (o, n): (u64, u64),
    max_blocks: usize,
) -> (Table, Restored) {
    remove_tmps_of(path);
    if !adopted {
        let _ = std::fs::remove_file(path);
        return (Table::new(max_blocks, n + 1), Restored::Fresh);
    }
    let why = match read_checkpoint(path) {
        Ok(bytes) => match Image::parse(&bytes) {
            Ok(img) if img.cut <= n && img.cut + 1 >= o => {
                let mut t = img.to_table(max_blocks);
                let records = catch_up(&mut t, reader, img.cut + 1, n);
                return (
                    t,
                    Restored::Checkpoint {
                        cut: img.cut,
                        records,
                    },
                );
            }
            Ok(img) => format!(
                "checkpoint cut {} is outside the ring's window [{o}, {n}]",
                img.cut
            ),
            Err(e) => format!("damaged checkpoint: {e}"),
        },
        Err(e) => e.to_string(),
    };
    // Where the state began is unknown: origin 0 (no window reaches back to it) and
    // incomplete, until a clear in the ring (or a later one) sets both.
    let mut t = Table::new(max_blocks, o);
    t.origin = 0;
    t.unknown = 1;
    catch_up(&mut t, reader, o, n);
    (t, Restored::Ring { why })
}

/// Applies ring records `from ..= to` to `t` (decoding them: only at start-up). A record the
/// ring no longer holds, or cannot give back, makes the table incomplete. Returns the records
/// applied.
fn catch_up(t: &mut Table, reader: &RingReader, from: u64, to: u64) -> u64 {
    if from > to {
        return 0;
    }
    let mut r = reader.clone();
    if r.seek(from).is_err() {
        t.lose(1);
        t.cut = to;
        return 0;
    }
    let mut buf = Vec::new();
    let mut applied = 0;
    let mut expect = from;
    while expect <= to {
        match r.next() {
            ReadOutcome::Record(v) => {
                let seq = v.seq();
                let meta = v.meta();
                if seq != expect || !v.copy_to(&mut buf) {
                    t.lose(1);
                    expect = seq + 1;
                    continue;
                }
                expect += 1;
                match KvEventBatch::decode(buf.as_slice()) {
                    Ok(batch) => {
                        t.apply_with(meta.dp_rank, seq, seq, &mut |v| visit_batch(&batch, v));
                        applied += 1;
                    }
                    Err(_) => t.lose(1),
                }
            }
            ReadOutcome::Lapped { .. } | ReadOutcome::Corrupt { .. } => t.lose(1),
            _ => break,
        }
    }
    if expect <= to {
        t.lose(1);
    }
    t.cut = to;
    applied
}

struct ProstStored<'a>(&'a KvBlocksStored);

impl StoredEvent for ProstStored<'_> {
    fn parent(&self) -> Option<i64> {
        self.0.parent_block_hash
    }
    fn tier(&self) -> Option<i32> {
        self.0.tier
    }
    fn group(&self) -> Option<u32> {
        self.0.group_idx
    }
    fn blocks(&self) -> usize {
        self.0.blocks.len()
    }
    fn hash(&self, i: usize) -> i64 {
        self.0.blocks[i].block_hash
    }
    fn write_attrs(&self, out: &mut Vec<u8>) {
        let attrs = KvBlocksStored {
            blocks: Vec::new(),
            parent_block_hash: None,
            ..self.0.clone()
        };
        attrs.encode(out).expect("a Vec grows");
    }
    fn write_block(&self, i: usize, out: &mut Vec<u8>) {
        prost::encoding::message::encode(1, &self.0.blocks[i], out);
    }
}

/// Shows a decoded record's events to `v`.
fn visit_batch(batch: &KvEventBatch, v: &mut dyn EventVisitor) {
    for ev in &batch.events {
        match &ev.data {
            Some(kv_cache_event::Data::Stored(s)) => v.stored(&ProstStored(s)),
            Some(kv_cache_event::Data::Removed(r)) => {
                v.removed(&r.block_hashes, r.tier, r.group_idx)
            }
            Some(kv_cache_event::Data::Cleared(_)) => v.cleared(),
            None => {}
        }
    }
}
