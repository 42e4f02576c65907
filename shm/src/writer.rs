//! The single writer: create or adopt, reserve → write in place → commit.

use crate::error::ShmError;
use crate::layout::*;
use crate::map::{geometry_for, Base, Geometry};
use crate::protocol::{record_crc, RecordMeta, Ring, Slot, WriterCursor};
use crate::sys;
use memmap2::MmapMut;

mod adopt;

use adopt::try_adopt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};

/// How [`RingWriter::open`] creates a ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterOptions {
    /// Data bytes, rounded up to a power of two, at least 64 KiB.
    /// Default 64 MiB. A ring of a different capacity is re-created.
    pub capacity: usize,
    /// First sequence number of a *new* ring (e.g. 1 for tests). `None`:
    /// previous high-water mark H + 2 if known, else Unix time in µs.
    pub seq_base: Option<u64>,
    /// File mode 0640 (and 0660 for the wake file) instead of 0600.
    pub group_read: bool,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            capacity: 64 << 20,
            seq_base: None,
            group_read: false,
        }
    }
}

/// Path of the small side file holding the futex waiter count.
pub fn wake_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".wake");
    PathBuf::from(s)
}

/// Why [`RingWriter::open`] replaced the file it found at the path instead of
/// adopting it (see [`RingWriter::replaced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replaced {
    /// A valid ring of another capacity: the configured size changed.
    Capacity {
        /// Data capacity of the old file.
        found: u64,
        /// Data capacity requested now.
        requested: u64,
    },
    /// A ring of another layout version (written by another kvbridge release).
    Version {
        /// Layout version of the old file.
        found: u32,
    },
    /// The file was marked retired by a writer that then did not replace it
    /// (it died between the two steps).
    Retired,
    /// The file is damaged: too short (truncated), not a kvbridge ring, an
    /// inconsistent header, cursors or records that do not validate. Says which.
    Damaged(String),
}

impl Replaced {
    /// True when the old file was damaged (rather than from another
    /// configuration or release): worth a warning, the retained history was
    /// lost to damage.
    pub fn is_damage(&self) -> bool {
        matches!(self, Replaced::Damaged(_))
    }
}

impl std::fmt::Display for Replaced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replaced::Capacity { found, requested } => write!(
                f,
                "it has a capacity of {found} bytes, {requested} were requested"
            ),
            Replaced::Version { found } => write!(
                f,
                "it has ring layout version {found}, this build writes version {LAYOUT_VERSION}"
            ),
            Replaced::Retired => write!(f, "it was marked retired by an earlier writer"),
            Replaced::Damaged(why) => write!(f, "it is damaged: {why}"),
        }
    }
}

/// Remove a ring file together with its wake side file ([`wake_path`]). Either
/// may be missing already. Processes that still have them mapped keep their
/// (now unlinked) files; readers find the path gone and report `WriterGone`.
/// Call it after the ring's writer is closed.
pub fn remove_ring(path: &Path) -> io::Result<()> {
    let gone = |r: io::Result<()>| match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    };
    let ring = gone(std::fs::remove_file(path));
    let wake = gone(std::fs::remove_file(wake_path(path)));
    ring.and(wake)
}

/// A file [`remove_stale_files`] removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleFile {
    /// The file removed.
    pub path: PathBuf,
    /// Why it was stale.
    pub reason: &'static str,
}

/// Remove leftovers that belong to the ring at `path` but that nothing uses
/// any more:
///
/// * `<path>.wake` when `<path>` itself does not exist (the ring was removed
///   and its wake file left behind);
/// * `<path>.tmp.<pid>.<id>`, a ring that a writer died while creating
///   ([`RingWriter::open`] builds a new file under that name), when no process
///   holds its lock and process `<pid>` is not alive (or is this process).
///
/// Call it before this process opens the ring: a file this process is
/// creating at the same moment could be taken for a leftover. Errors reading
/// the directory are returned; a file that cannot be examined is left alone.
pub fn remove_stale_files(path: &Path) -> io::Result<Vec<StaleFile>> {
    let mut removed = Vec::new();
    let wake = wake_path(path);
    if !path.exists() && wake.exists() && std::fs::remove_file(&wake).is_ok() {
        removed.push(StaleFile {
            path: wake,
            reason: "its ring file is gone",
        });
    }
    let (Some(name), dir) = (path.file_name(), path.parent()) else {
        return Ok(removed);
    };
    let dir = match dir {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut prefix = name.to_owned();
    prefix.push(".tmp.");
    let prefix = prefix.as_encoded_bytes().to_vec();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let file_name = entry.file_name();
        let Some(rest) = file_name.as_encoded_bytes().strip_prefix(prefix.as_slice()) else {
            continue;
        };
        // <pid>.<hex ring id>
        let Some(pid) = std::str::from_utf8(rest)
            .ok()
            .and_then(|r| r.split_once('.'))
            .filter(|(_, id)| !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && sys::pid_exists(pid) != Some(false) {
            continue; // its creator may still be at work
        }
        let tmp = entry.path();
        let Ok(f) = OpenOptions::new().read(true).write(true).open(&tmp) else {
            continue;
        };
        // A creator holds the lock from right after creating the file until it is in place.
        if sys::try_lock_exclusive(&f).unwrap_or(false) && std::fs::remove_file(&tmp).is_ok() {
            removed.push(StaleFile {
                path: tmp,
                reason: "a writer died while creating this ring",
            });
        }
    }
    Ok(removed)
}

/// The one writer of a ring file. Holds an exclusive `flock` on the file for
/// its whole life; the kernel releases it when the process dies.
pub struct RingWriter {
    path: PathBuf,
    file: File,
    map: MmapMut,
    geo: Geometry,
    cur: WriterCursor,
    adopted: bool,
    replaced: Option<Replaced>,
    /// Set once the file was found truncated: from then on nothing touches
    /// the mapping (a page past the file's end is `SIGBUS`).
    truncated: Option<u64>,
    wake: Option<MmapMut>,
}

// The raw pointers are only derived from `map`, which is Send.
impl std::fmt::Debug for RingWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingWriter")
            .field("path", &self.path)
            .field("ring_id", &self.geo.ring_id)
            .field("cursor", &self.cur)
            .field("adopted", &self.adopted)
            .field("replaced", &self.replaced)
            .field("truncated", &self.truncated)
            .finish()
    }
}

enum Opened {
    Adopt(RingWriter),
    /// Re-create; `old` keeps the old file locked until the new one is in place.
    Recreate {
        high_water: Option<u64>,
        old: File,
        why: Replaced,
    },
}

fn unix_us() -> u64 {
    sys::now_ns() / 1000
}

impl RingWriter {
    /// Create the ring at `path`, or adopt the valid ring already there and
    /// continue its sequence at N + 1. A file that cannot be validated is
    /// replaced (atomically, by rename) by a new ring with a new ring id.
    pub fn open(path: &Path, opts: &WriterOptions) -> Result<RingWriter, ShmError> {
        let cap = opts
            .capacity
            .max(MIN_CAPACITY)
            .checked_next_power_of_two()
            .ok_or_else(|| ShmError::InvalidOption("capacity too large".into()))?
            as u64;
        if opts.seq_base == Some(0) {
            return Err(ShmError::InvalidOption("seq_base must be >= 1".into()));
        }
        let mode = if opts.group_read { 0o640 } else { 0o600 };
        for _ in 0..32 {
            let file = match OpenOptions::new().read(true).write(true).open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let base = opts.seq_base.unwrap_or_else(unix_us);
                    match create(path, cap, base, mode, false)? {
                        Some(w) => return Ok(w),
                        None => continue, // lost a creation race: retry
                    }
                }
                Err(e) => return Err(ShmError::io(path, e)),
            };
            if !sys::try_lock_exclusive(&file).map_err(|e| ShmError::io(path, e))? {
                return Err(ShmError::Locked {
                    path: path.into(),
                    pid: peek_pid(&file),
                });
            }
            // The path may have been replaced between open and lock.
            let same = match (file.metadata(), std::fs::metadata(path)) {
                (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                _ => false,
            };
            if !same {
                continue;
            }
            match try_adopt(path, file, cap, mode)? {
                Opened::Adopt(w) => return Ok(w),
                Opened::Recreate {
                    high_water,
                    old,
                    why,
                } => {
                    let base = opts
                        .seq_base
                        .or(high_water.map(|h| h + 2))
                        .unwrap_or_else(unix_us);
                    let created = create(path, cap, base, mode, true);
                    // Only now release the old file's lock: a writer that
                    // locked it earlier could otherwise adopt the file we
                    // are replacing.
                    drop(old);
                    if let Some(mut w) = created? {
                        w.replaced = Some(why);
                        return Ok(w);
                    }
                }
            }
        }
        Err(ShmError::Io {
            path: path.into(),
            source: io::Error::other("ring file kept changing while opening"),
        })
    }

    fn base(&self) -> Base<'_> {
        Base::new(&self.map)
    }

    fn ring(&self) -> Ring<'_> {
        self.base().ring(&self.geo)
    }

    /// The ring id chosen when the file was created.
    pub fn ring_id(&self) -> u64 {
        self.geo.ring_id
    }
    /// True when an existing valid ring was continued.
    pub fn adopted(&self) -> bool {
        self.adopted
    }
    /// Why the file found at the path was replaced by this new ring, if one was
    /// (`None`: adopted, or there was no file).
    pub fn replaced(&self) -> Option<&Replaced> {
        self.replaced.as_ref()
    }
    /// The sequence number the next [`reserve`](Self::reserve) gets.
    pub fn next_seq(&self) -> u64 {
        self.cur.next_seq
    }
    /// O, the oldest retained sequence number (N + 1 when empty).
    pub fn oldest(&self) -> u64 {
        self.cur.oldest.min(self.cur.next_seq)
    }
    /// N, the newest published sequence number.
    pub fn newest(&self) -> u64 {
        self.cur.next_seq - 1
    }
    /// Largest payload accepted (a quarter of the capacity minus the header).
    pub fn max_record_len(&self) -> usize {
        self.geo.max_payload
    }
    /// Data capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.geo.cap as usize
    }
    /// The writer's private cursors (tests and diagnostics).
    #[doc(hidden)]
    pub fn cursor(&self) -> WriterCursor {
        self.cur
    }

    /// The ring file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reserve space for a `len`-byte payload. The records it will overwrite
    /// are retired (stop being readable) before this returns.
    pub fn reserve(&mut self, len: usize) -> Result<Reservation<'_>, ShmError> {
        if let Some(now) = self.truncated {
            return Err(self.truncated_error(now));
        }
        if len > self.geo.max_payload {
            return Err(ShmError::RecordTooLarge {
                len,
                max: self.geo.max_payload,
            });
        }
        let mut cur = self.cur;
        let slot = self.ring().reserve(&mut cur, len);
        self.cur = cur;
        Ok(Reservation { w: self, slot })
    }

    /// Convenience: reserve, copy `payload`, commit. Returns the sequence.
    pub fn append(&mut self, payload: &[u8], meta: RecordMeta) -> Result<u64, ShmError> {
        let mut r = self.reserve(payload.len())?;
        r.buf().copy_from_slice(payload);
        let seq = r.seq();
        r.commit(meta);
        Ok(seq)
    }

    /// The writer notes the ring holds (LAYOUT.md §3.1): what the previous writer of an
    /// adopted ring left with [`set_notes`](Self::set_notes), empty for a new ring. Readers
    /// never see them; a writer keeps in them what it must know again after a restart and
    /// cannot derive from the records.
    pub fn notes(&self) -> Vec<[u8; NOTE_LEN]> {
        if self.truncated.is_some() {
            return Vec::new();
        }
        let b = self.base();
        // Acquire: pairs with the Release store of the control word in `set_notes`, so the
        // area it names is read as completely written.
        let ctl = b.u64_at(OFF_NOTES_CTL).load(Ordering::Acquire);
        let n = (ctl as u32 as usize).min(NOTES_MAX);
        let area = if ctl >> 32 & 1 == 0 {
            OFF_NOTES_A
        } else {
            OFF_NOTES_B
        };
        (0..n)
            .map(|i| {
                let at = area + i * NOTE_LEN;
                let lo = b.u64_at(at).load(Ordering::Relaxed);
                let hi = b.u64_at(at + 8).load(Ordering::Relaxed);
                let mut note = [0u8; NOTE_LEN];
                note[..8].copy_from_slice(&lo.to_le_bytes());
                note[8..].copy_from_slice(&hi.to_le_bytes());
                note
            })
            .collect()
    }

    /// Replaces the writer notes with `notes` (at most [`NOTES_MAX`]), atomically with respect
    /// to a crash: they are written to the inactive area, which one store of the control word
    /// then makes the active one. A writer killed at any point leaves either the old notes or
    /// the new ones.
    pub fn set_notes(&mut self, notes: &[[u8; NOTE_LEN]]) -> Result<(), ShmError> {
        if let Some(now) = self.truncated {
            return Err(self.truncated_error(now));
        }
        if notes.len() > NOTES_MAX {
            return Err(ShmError::InvalidOption(format!(
                "{} writer notes, the ring header holds {NOTES_MAX}",
                notes.len()
            )));
        }
        let b = self.base();
        let ctl = b.u64_at(OFF_NOTES_CTL).load(Ordering::Relaxed);
        let next = (ctl >> 32 & 1) ^ 1;
        let area = if next == 0 { OFF_NOTES_A } else { OFF_NOTES_B };
        for (i, note) in notes.iter().enumerate() {
            let at = area + i * NOTE_LEN;
            let lo = u64::from_le_bytes(note[..8].try_into().expect("8 bytes"));
            let hi = u64::from_le_bytes(note[8..].try_into().expect("8 bytes"));
            b.u64_at(at).store(lo, Ordering::Relaxed);
            b.u64_at(at + 8).store(hi, Ordering::Relaxed);
        }
        // Release: pairs with the Acquire load in `notes` (this writer's successor, after
        // adoption): the area's stores above are visible before the control word names it.
        b.u64_at(OFF_NOTES_CTL)
            .store(next << 32 | notes.len() as u64, Ordering::Release);
        Ok(())
    }

    /// Check that the file is still whole, then store the current time as
    /// the writer heartbeat. Call it every ~100 ms: it is where a ring file
    /// truncated under the writer is noticed (see [`check`](Self::check)).
    pub fn heartbeat(&mut self) -> Result<(), ShmError> {
        self.check()?;
        self.beat();
        Ok(())
    }

    /// Is the ring file still as long as its layout needs? A file truncated
    /// under the writer (by anyone who can open it) turns every access to a
    /// page past its new end into `SIGBUS`. `fstat` on the writer's own
    /// descriptor finds that out without touching the mapping; from then on
    /// this writer never touches the mapping again: [`reserve`](Self::reserve)
    /// and this check return [`ShmError::Truncated`], and dropping it skips the
    /// clean-close stores. (An access between the truncation and this check
    /// cannot be protected.)
    pub fn check(&mut self) -> Result<(), ShmError> {
        if let Some(now) = self.truncated {
            return Err(self.truncated_error(now));
        }
        let len = self
            .file
            .metadata()
            .map_err(|e| ShmError::io(&self.path, e))?
            .len();
        if len < self.geo.file_len {
            self.truncated = Some(len);
            return Err(self.truncated_error(len));
        }
        Ok(())
    }

    fn truncated_error(&self, len: u64) -> ShmError {
        ShmError::Truncated {
            path: self.path.clone(),
            len,
            need: self.geo.file_len,
        }
    }

    /// Store the heartbeat (every commit; no check).
    fn beat(&self) {
        self.base()
            .u64_at(OFF_HEARTBEAT_NS)
            .store(sys::coarse_now_ns(), Ordering::Release);
    }

    fn notify_word(&self) -> &AtomicU32 {
        self.base().u32_at(OFF_NOTIFY)
    }

    fn wake_readers(&self) {
        let notify = self.notify_word();
        notify.store(
            notify.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Release,
        );
        // Dekker with the reader: we store `notify` then load `waiters`; a
        // reader stores `waiters` then loads `notify`. SeqCst fences on both
        // sides guarantee at least one of us sees the other's store.
        fence(Ordering::SeqCst);
        let must_wake = match &self.wake {
            Some(m) => {
                Base::new(m)
                    .u32_at(WAKE_OFF_WAITERS)
                    .load(Ordering::Relaxed)
                    != 0
            }
            None => true,
        };
        if must_wake {
            sys::futex_wake_all(notify);
        }
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        if self.truncated.is_some() {
            return; // the mapping must not be touched (SIGBUS)
        }
        // Clean close: readers see WriterGone at once.
        self.base()
            .u32_at(OFF_WRITER_PID)
            .store(0, Ordering::Release);
        self.wake_readers();
        // The flock goes with `file`.
    }
}

/// A reserved record; write the payload into [`buf`](Self::buf), then
/// [`commit`](Self::commit). Dropping it publishes nothing and does not
/// consume the sequence number.
pub struct Reservation<'a> {
    w: &'a mut RingWriter,
    slot: Slot,
}

impl std::fmt::Debug for Reservation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("slot", &self.slot)
            .finish()
    }
}

impl Reservation<'_> {
    /// The sequence number this record will have.
    pub fn seq(&self) -> u64 {
        self.slot.seq
    }

    /// Exactly `len` bytes, in the shared mapping.
    pub fn buf(&mut self) -> &mut [u8] {
        let g = &self.w.geo;
        let off = g.data_off as usize + self.w.ring().payload_offset(self.slot.start);
        debug_assert!(off + self.slot.len <= self.w.map.len());
        // SAFETY: `off..off+len` lies inside the data area (the protocol never
        // lets a record straddle the end of the area, and `len <= max_payload`
        // was checked in `reserve`). We hold `&mut` to the writer, so no other
        // `buf` of this process aliases it. Readers in other processes may
        // read these bytes concurrently, but only after the protocol has
        // retired them (intent published); they re-validate after reading and
        // discard what they read, so no reader ever *acts* on racy bytes.
        unsafe { std::slice::from_raw_parts_mut(self.w.map.as_mut_ptr().add(off), self.slot.len) }
    }

    /// Publish the record with its metadata and checksum, and wake sleeping readers.
    pub fn commit(mut self, meta: RecordMeta) {
        let crc = record_crc(self.slot.seq, self.slot.len, &meta, self.buf());
        let mut cur = self.w.cur;
        self.w.ring().commit(&mut cur, self.slot, meta, crc);
        self.w.cur = cur;
        self.w.beat();
        self.w.wake_readers();
    }
}

fn peek_pid(file: &File) -> u32 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 4];
    match file.read_exact_at(&mut b, OFF_WRITER_PID as u64) {
        Ok(()) => u32::from_le_bytes(b),
        Err(_) => 0,
    }
}

fn map_rw(path: &Path, file: &File) -> Result<MmapMut, ShmError> {
    // SAFETY: the file is a ring file we hold the exclusive writer lock on;
    // other processes only map it read-only and never truncate it; the
    // mapping is only accessed through atomics or the writer-exclusive
    // reservation buffer.
    unsafe { MmapMut::map_mut(file) }.map_err(|e| ShmError::io(path, e))
}

fn open_wake(path: &Path, mode: u32) -> Option<MmapMut> {
    let wp = wake_path(path);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(mode)
        .open(&wp)
        .ok()?;
    // Readers must be able to bump the waiter count: owner (and, with
    // group_read, group) get write permission on this one small file.
    let wmode = if mode & 0o040 != 0 { 0o660 } else { 0o600 };
    let _ = f.set_permissions(std::fs::Permissions::from_mode(wmode));
    if f.metadata().ok()?.len() < WAKE_LEN {
        sys::fallocate(&f, WAKE_LEN).ok()?;
    }
    // SAFETY: a 4 KiB side file only ever accessed through atomics.
    let m = unsafe { MmapMut::map_mut(&f) }.ok()?;
    Base::new(&m).u64_at(0).store(WAKE_MAGIC, Ordering::Release);
    Some(m)
}

/// Create a new ring file: build it under a temporary name, then link (new
/// path) or rename (replacing) it into place so that no reader ever maps a
/// half-initialised file. Returns `None` if another writer created the path
/// first.
fn create(
    path: &Path,
    cap: u64,
    seq_base: u64,
    mode: u32,
    replace: bool,
) -> Result<Option<RingWriter>, ShmError> {
    let ring_id = sys::random_u64();
    let g = geometry_for(cap, ring_id);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}.{:x}", std::process::id(), ring_id));
    let tmp = PathBuf::from(tmp);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| ShmError::io(path, e))?;
    let cleanup = |e: ShmError| {
        let _ = std::fs::remove_file(&tmp);
        e
    };
    // Exact mode regardless of umask.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| cleanup(ShmError::io(path, e)))?;
    if !sys::try_lock_exclusive(&file).map_err(|e| cleanup(ShmError::io(path, e)))? {
        return Err(cleanup(ShmError::Locked {
            path: path.into(),
            pid: 0,
        }));
    }
    if let Err(e) = sys::fallocate(&file, g.file_len) {
        let err = if e.raw_os_error() == Some(libc::ENOSPC) {
            ShmError::NoSpace {
                path: path.into(),
                requested: g.file_len,
            }
        } else {
            ShmError::io(path, e)
        };
        return Err(cleanup(err));
    }
    let map = map_rw(path, &file).map_err(cleanup)?;
    write_header(Base::new(&map), &g, ring_id, cap, seq_base);
    let placed = if replace {
        std::fs::rename(&tmp, path)
    } else {
        std::fs::hard_link(&tmp, path).and_then(|()| std::fs::remove_file(&tmp))
    };
    match placed {
        Ok(()) => {}
        Err(e) if !replace && e.kind() == io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&tmp);
            return Ok(None);
        }
        Err(e) => return Err(cleanup(ShmError::io(path, e))),
    }
    let wake = open_wake(path, mode);
    Ok(Some(RingWriter {
        path: path.into(),
        file,
        map,
        geo: g,
        cur: WriterCursor {
            tail: 0,
            head: 0,
            oldest: seq_base,
            intent: 0,
            next_seq: seq_base,
        },
        adopted: false,
        replaced: None,
        truncated: None,
        wake,
    }))
}

/// Initialises a new ring's header, cursors and index in `b`; the magic number, stored last
/// with `Release`, publishes them.
fn write_header(b: Base<'_>, g: &Geometry, ring_id: u64, cap: u64, seq_base: u64) {
    let w = Ordering::Relaxed;
    b.u32_at(OFF_VERSION).store(LAYOUT_VERSION, w);
    b.u32_at(OFF_HEADER_LEN).store(HEADER_LEN as u32, w);
    b.u64_at(OFF_RING_ID).store(ring_id, w);
    b.u64_at(OFF_CAPACITY).store(cap, w);
    b.u64_at(OFF_INDEX_SLOTS).store(g.slots, w);
    b.u64_at(OFF_INDEX_OFFSET).store(g.index_off, w);
    b.u64_at(OFF_DATA_OFFSET).store(g.data_off, w);
    b.u64_at(OFF_SEQ_BASE).store(seq_base, w);
    b.u32_at(OFF_WRITER_PID).store(std::process::id(), w);
    b.u32_at(OFF_STATE).store(STATE_ACTIVE, w);
    b.u64_at(OFF_HEARTBEAT_NS).store(sys::now_ns(), w);
    b.u64_at(OFF_PIDNS_INO).store(sys::pidns_ino(), w);
    b.u64_at(OFF_CREATED_NS).store(sys::now_ns(), w);
    b.u64_at(OFF_MAX_PAYLOAD).store(g.max_payload as u64, w);
    b.u64_at(OFF_TAIL).store(0, w);
    b.u64_at(OFF_NEWEST).store(seq_base - 1, w);
    b.u64_at(OFF_INTENT).store(0, w);
    b.u64_at(OFF_OLDEST).store(seq_base, w);
    b.u64_at(OFF_HEAD).store(0, w);
    for s in b.words(g.index_off, g.slots * 8) {
        s.store(u64::MAX, w);
    }
    b.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
}
