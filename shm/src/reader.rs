//! Read-only readers: zero-copy views, explicit lap / reset / writer-gone
//! outcomes, futex waiting.

use crate::error::{SeekError, ShmError};
use crate::fault;
use crate::layout::*;
use crate::map::{parse_header, Base, Geometry};
use crate::protocol::{record_crc_header, Read, RecordMeta, Ring};
use crate::sys;
use crate::writer::wake_path;
use memmap2::{Mmap, MmapMut};
use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Heartbeats younger than this prove the writer alive without a syscall.
const FRESH_HEARTBEAT_NS: u64 = 250_000_000;
/// How often an idle reader re-checks that the path still names its file.
const RESET_CHECK_EVERY: Duration = Duration::from_millis(20);
/// Busy-spin before sleeping on the futex (the default of [`RingReader::set_spin`]).
const SPIN: Duration = Duration::from_micros(20);

struct Mapped {
    path: PathBuf,
    /// Registers `map`'s range with the truncation-fault handler. Declared before `map` so that
    /// it is dropped (unregistered) before the range is unmapped.
    guard: fault::Guard,
    map: Mmap,
    geo: Geometry,
    dev: u64,
    ino: u64,
    /// The wake side file, when this reader may write it (to count itself
    /// as a sleeper). Without it the reader sleeps in short timed waits.
    wake: Option<MmapMut>,
    own_pidns: u64,
}

impl Mapped {
    fn open(path: &Path) -> Result<Mapped, ShmError> {
        let file = File::open(path).map_err(|e| ShmError::io(path, e))?;
        let md = file.metadata().map_err(|e| ShmError::io(path, e))?;
        if md.len() < HEADER_LEN {
            return Err(ShmError::TooSmall {
                path: path.into(),
                len: md.len(),
                need: HEADER_LEN,
            });
        }
        // SAFETY: a read-only shared mapping. The writer never shrinks the
        // file (it replaces it by rename instead), so the mapped range stays
        // backed; all concurrently-mutated words are read through atomics,
        // payload bytes through validated `RecordView`s.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ShmError::io(path, e))?;
        // Guarded before the first access: a file truncated from here on reads as zeros
        // instead of raising SIGBUS (fault.rs), and the reader reports it.
        let guard = fault::guard(map.as_ptr(), map.len());
        let geo = parse_header(path, Base::new(&map))?;
        if guard.faulted() {
            return Err(ShmError::TooSmall {
                path: path.into(),
                len: file.metadata().map(|m| m.len()).unwrap_or(0),
                need: map.len() as u64,
            });
        }
        let wake = OpenOptions::new()
            .read(true)
            .write(true)
            .open(wake_path(path))
            .ok()
            .filter(|f| f.metadata().map(|m| m.len() >= WAKE_LEN).unwrap_or(false))
            // SAFETY: 4 KiB side file accessed only through atomics.
            .and_then(|f| unsafe { MmapMut::map_mut(&f) }.ok())
            .filter(|m| Base::new(m).load(0) == WAKE_MAGIC);
        Ok(Mapped {
            path: path.into(),
            guard,
            map,
            geo,
            dev: md.dev(),
            ino: md.ino(),
            wake,
            own_pidns: sys::pidns_ino(),
        })
    }

    fn base(&self) -> Base<'_> {
        Base::new(&self.map)
    }

    fn ring(&self) -> Ring<'_> {
        self.base().ring(&self.geo)
    }

    /// Pointer to the first payload byte of a `len`-byte record at `pos`
    /// (in bounds: asserted).
    fn payload_ptr(&self, pos: u64, len: usize) -> *const u8 {
        let off = self.geo.data_off as usize + self.ring().payload_offset(pos);
        assert!(off + len <= self.map.len());
        // SAFETY: `off + len` is within the mapping (asserted above; `Ring::read` also proved
        // the record lies inside the data area), so the offset pointer stays in the allocation.
        unsafe { self.map.as_ptr().add(off) }
    }

    fn waiters(&self) -> Option<&AtomicU32> {
        self.wake
            .as_ref()
            .map(|m| Base::new(m).u32_at(WAKE_OFF_WAITERS))
    }
}

/// A reader of one ring file. Cloning shares the read-only mapping; each
/// clone has its own position.
#[derive(Clone)]
pub struct RingReader {
    m: Arc<Mapped>,
    pos: Cell<u64>,
    stale_after: Duration,
    spin: Duration,
    last_stat: Cell<Option<Instant>>,
}

/// What [`RingReader::next`] found.
#[derive(Debug)]
pub enum ReadOutcome<'a> {
    /// The next record, zero-copy.
    Record(RecordView<'a>),
    /// Nothing new (the writer is alive or its state is unknown).
    Empty,
    /// The writer overwrote records this reader still wanted. The position
    /// is already moved to `resume_at`; `missed = resume_at - wanted`.
    Lapped {
        /// Records lost to the writer.
        missed: u64,
        /// The next record this reader will return (the oldest retained).
        resume_at: u64,
    },
    /// The file was re-created (new ring id). The reader switched to the new
    /// file, at its oldest record.
    RingReset {
        /// The new file's ring id.
        new_ring_id: u64,
    },
    /// Nothing new and the writer is dead or closed.
    WriterGone,
    /// Record `seq` is damaged: its header is inconsistent or its checksum
    /// does not match, although the writer has not touched it since it was
    /// committed (an overwrite by the writer is reported as `Lapped`). Its
    /// bytes were changed by something other than the writer: a bit flip or a
    /// stray or malicious write to the file. The record is skipped; the
    /// position is already moved to `resume_at` = `seq + 1`.
    Corrupt {
        /// The damaged record.
        seq: u64,
        /// The next record this reader will return.
        resume_at: u64,
    },
    /// The ring file was truncated under this reader (someone shrank the file it maps): a page
    /// of the mapping is gone. Without this the access would have been `SIGBUS`. Nothing read
    /// from the mapping since can be trusted, and this reader returns `Truncated` from now on
    /// without touching it; open a new reader once the writer has re-created the ring.
    Truncated,
}

enum Polled {
    Record {
        seq: u64,
        pos: u64,
        len: usize,
        meta: RecordMeta,
    },
    Empty,
    Lapped {
        missed: u64,
        resume_at: u64,
    },
    Corrupt {
        seq: u64,
        resume_at: u64,
    },
}

enum Idle {
    Empty,
    Gone,
    Reset(u64),
}

impl std::fmt::Debug for RingReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingReader")
            .field("path", &self.m.path)
            .field("ring_id", &self.m.geo.ring_id)
            .field("position", &self.pos.get())
            .finish()
    }
}

impl RingReader {
    /// Map `path` read-only. The position starts at the oldest record.
    pub fn open(path: &Path) -> Result<RingReader, ShmError> {
        let m = Mapped::open(path)?;
        let r = RingReader {
            m: Arc::new(m),
            pos: Cell::new(0),
            stale_after: Duration::from_secs(1),
            spin: SPIN,
            last_stat: Cell::new(None),
        };
        r.pos.set(r.oldest());
        Ok(r)
    }

    /// Heartbeat age after which a writer whose pid cannot be checked is
    /// declared gone (default 1 s; the service beats every ~100 ms).
    pub fn set_stale_after(&mut self, d: Duration) {
        self.stale_after = d;
    }

    /// How long [`next_blocking`](Self::next_blocking) busy-polls before it sleeps on the
    /// futex (default 20 µs). Spinning catches a record that follows within microseconds
    /// without a wake-up, at the price of a core; `Duration::ZERO` makes the reader a pure
    /// waiter (for bindings whose users asked for a reader that does not burn CPU while idle,
    /// and for measuring the futex wake-up alone).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// The ring incarnation's random id (changes when the file is re-created).
    pub fn ring_id(&self) -> u64 {
        self.m.geo.ring_id
    }
    /// The ring incarnation's 16-byte identity: its id, then its creation time (ns since the
    /// Unix epoch), both big-endian. Both are written before the file is renamed into place and
    /// never change, so the identity is the same for every reader and writer of one file, across
    /// writer restarts that adopt it, and new when the file is re-created.
    pub fn identity(&self) -> [u8; 16] {
        let mut id = [0; 16];
        id[..8].copy_from_slice(&self.m.geo.ring_id.to_be_bytes());
        id[8..].copy_from_slice(&self.m.base().load(OFF_CREATED_NS).to_be_bytes());
        id
    }
    /// Data capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.m.geo.cap as usize
    }
    /// The ring file this reader maps.
    pub fn path(&self) -> &Path {
        &self.m.path
    }
    /// O: the oldest retained record (N + 1 when the ring is empty).
    pub fn oldest(&self) -> u64 {
        let r = self.m.ring();
        let n = r.newest.load(Ordering::Acquire);
        r.oldest.load(Ordering::Acquire).min(n + 1)
    }
    /// N: the newest published record.
    pub fn newest(&self) -> u64 {
        self.m.ring().newest.load(Ordering::Acquire)
    }
    /// The sequence number the next `next()` will try to return.
    pub fn position(&self) -> u64 {
        self.pos.get()
    }

    /// Move to `seq`; `seq` in `[O, N + 1]` is accepted (N + 1 = live tail).
    pub fn seek(&mut self, seq: u64) -> Result<(), SeekError> {
        let r = self.m.ring();
        let newest = r.newest.load(Ordering::Acquire);
        let oldest = r.oldest.load(Ordering::Acquire).min(newest + 1);
        if seq > newest + 1 {
            return Err(SeekError::Future {
                requested: seq,
                newest,
            });
        }
        if seq < oldest {
            return Err(SeekError::TooOld {
                requested: seq,
                oldest,
                newest,
            });
        }
        self.pos.set(seq);
        Ok(())
    }

    fn poll(&self) -> Polled {
        let want = self.pos.get();
        let ring = self.m.ring();
        let read = match ring.read(want) {
            Read::Record {
                pos,
                len,
                meta,
                crc,
            } => {
                let sum = self.payload_crc(record_crc_header(want, len, &meta), pos, len);
                match ring.verify(want, pos, sum == crc) {
                    Ok(()) => {
                        self.pos.set(want + 1);
                        return Polled::Record {
                            seq: want,
                            pos,
                            len,
                            meta,
                        };
                    }
                    Err(r) => r,
                }
            }
            r => r,
        };
        match read {
            Read::Lapped { resume_at } => {
                self.pos.set(resume_at);
                Polled::Lapped {
                    missed: resume_at - want,
                    resume_at,
                }
            }
            Read::Corrupt { resume_at } => {
                self.pos.set(resume_at);
                Polled::Corrupt {
                    seq: want,
                    resume_at,
                }
            }
            Read::Empty => Polled::Empty,
            Read::Record { .. } => unreachable!("Ring::verify fails only with Lapped or Corrupt"),
        }
    }

    /// `crc` continued over the `len` payload bytes at `pos`. The writer may be rewriting those
    /// bytes meanwhile, so no reference to them is formed: they are copied through raw pointers,
    /// a piece at a time, into a buffer of this thread's, and only the copy is checksummed. The
    /// result counts only if `Ring::verify` then finds the record intact (otherwise the read is
    /// a lap and the sum is discarded).
    fn payload_crc(&self, mut crc: u32, pos: u64, len: usize) -> u32 {
        const PIECE: usize = 4096;
        let mut buf = [0u8; PIECE];
        let src = self.m.payload_ptr(pos, len);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PIECE);
            // SAFETY: `src + done .. src + done + n` lies within the `len` bytes that
            // `payload_ptr` proved in bounds; `buf` is a distinct local array of at least `n`
            // bytes. The mapping is read-only here, and racing bytes are only copied (a seqlock
            // read, validated by `Ring::verify`), never borrowed.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), buf.as_mut_ptr(), n) };
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            done += n;
        }
        crc
    }

    /// Classify an empty poll: reset, writer gone, or just nothing new.
    fn idle(&mut self) -> Idle {
        let b = self.m.base();
        let mut replaced = b.load32(OFF_STATE) == STATE_RETIRED;
        if !replaced {
            let now = Instant::now();
            let due = self
                .last_stat
                .get()
                .is_none_or(|t| now.duration_since(t) >= RESET_CHECK_EVERY);
            if due {
                self.last_stat.set(Some(now));
                replaced = match std::fs::metadata(&self.m.path) {
                    Ok(md) => md.ino() != self.m.ino || md.dev() != self.m.dev,
                    Err(_) => true,
                };
            }
        }
        if replaced {
            return match Mapped::open(&self.m.path) {
                Ok(new) if new.ino != self.m.ino || new.dev != self.m.dev => {
                    let id = new.geo.ring_id;
                    self.m = Arc::new(new);
                    self.last_stat.set(None);
                    self.pos.set(self.oldest());
                    Idle::Reset(id)
                }
                _ => Idle::Gone,
            };
        }
        if self.writer_alive() {
            Idle::Empty
        } else {
            Idle::Gone
        }
    }

    /// Is the writer process alive? Clean close → false at once; SIGKILL →
    /// false once the heartbeat is 250 ms old and the pid is gone (same pid
    /// namespace), or once the heartbeat is older than `stale_after`.
    pub fn writer_alive(&self) -> bool {
        let b = self.m.base();
        let pid = b.load32(OFF_WRITER_PID);
        if pid == 0 || b.load32(OFF_STATE) == STATE_RETIRED {
            return false;
        }
        let age = sys::now_ns().saturating_sub(b.load(OFF_HEARTBEAT_NS));
        if age <= FRESH_HEARTBEAT_NS {
            return true;
        }
        let pidns = b.load(OFF_PIDNS_INO);
        if pidns != 0 && pidns == self.m.own_pidns && sys::pid_exists(pid) == Some(false) {
            return false;
        }
        age <= self.stale_after.as_nanos() as u64
    }

    fn outcome(&self, p: Polled) -> ReadOutcome<'_> {
        // Whatever was polled from a mapping that faulted meanwhile is zeros, not the file.
        if self.truncated() {
            return ReadOutcome::Truncated;
        }
        match p {
            Polled::Record {
                seq,
                pos,
                len,
                meta,
            } => ReadOutcome::Record(RecordView {
                r: self,
                seq,
                pos,
                len,
                meta,
            }),
            Polled::Empty => ReadOutcome::Empty,
            Polled::Lapped { missed, resume_at } => ReadOutcome::Lapped { missed, resume_at },
            Polled::Corrupt { seq, resume_at } => ReadOutcome::Corrupt { seq, resume_at },
        }
    }

    /// Non-blocking read of the record at [`position`](Self::position).
    #[allow(clippy::should_implement_trait)] // name fixed by kvbridge's API
    pub fn next(&mut self) -> ReadOutcome<'_> {
        if self.truncated() {
            return ReadOutcome::Truncated;
        }
        let p = self.poll();
        if let Polled::Empty = p {
            let idle = self.idle();
            if self.truncated() {
                return ReadOutcome::Truncated;
            }
            return match idle {
                Idle::Empty => ReadOutcome::Empty,
                Idle::Gone => ReadOutcome::WriterGone,
                Idle::Reset(id) => ReadOutcome::RingReset { new_ring_id: id },
            };
        }
        self.outcome(p)
    }

    /// Whether the ring file was truncated under this reader ([`ReadOutcome::Truncated`]).
    pub fn truncated(&self) -> bool {
        self.m.guard.faulted()
    }

    /// Like [`next`](Self::next) but waits up to `timeout` for a record:
    /// spins ~20 µs ([`set_spin`](Self::set_spin)), then sleeps on the shared futex. While the writer is
    /// gone it keeps waiting (a restarted writer wakes it) and returns
    /// `WriterGone` only when the timeout expires with nothing to read.
    pub fn next_blocking(&mut self, timeout: Duration) -> ReadOutcome<'_> {
        let start = Instant::now();
        let deadline = start + timeout;
        loop {
            if self.truncated() {
                return ReadOutcome::Truncated;
            }
            let p = self.poll();
            if !matches!(p, Polled::Empty) {
                return self.outcome(p);
            }
            let want = self.pos.get();
            // Spin briefly: a record usually follows within microseconds.
            let mut arrived = false;
            let spin_until = (Instant::now() + self.spin).min(deadline);
            'spin: while !self.spin.is_zero() {
                for _ in 0..64 {
                    if self.m.ring().newest.load(Ordering::Relaxed) >= want {
                        arrived = true;
                        break 'spin;
                    }
                    std::hint::spin_loop();
                }
                if Instant::now() >= spin_until {
                    break;
                }
            }
            if arrived {
                continue;
            }
            let idle = self.idle();
            if self.truncated() {
                return ReadOutcome::Truncated;
            }
            let gone = match idle {
                Idle::Reset(id) => return ReadOutcome::RingReset { new_ring_id: id },
                Idle::Gone => true,
                Idle::Empty => false,
            };
            let now = Instant::now();
            if now >= deadline {
                return if gone {
                    ReadOutcome::WriterGone
                } else {
                    ReadOutcome::Empty
                };
            }
            self.sleep(want, (deadline - now).min(Duration::from_millis(100)));
        }
    }

    /// Sleep on the futex until the writer publishes past `want - 1`, the
    /// timeout, or a spurious wake.
    fn sleep(&self, want: u64, max: Duration) {
        let m = &*self.m;
        let notify = m.base().u32_at(OFF_NOTIFY);
        let waiters = m.waiters();
        if let Some(w) = waiters {
            w.fetch_add(1, Ordering::SeqCst);
        }
        // Dekker with the writer's commit (see RingWriter::wake_readers).
        fence(Ordering::SeqCst);
        let v = notify.load(Ordering::Acquire);
        let published = m.ring().newest.load(Ordering::Acquire) >= want;
        if !published {
            // Unregistered readers cannot be woken reliably: poll at 1 ms.
            let t = if waiters.is_some() {
                max
            } else {
                max.min(Duration::from_millis(1))
            };
            sys::futex_wait(notify, v, t);
        }
        if let Some(w) = waiters {
            w.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A zero-copy view of one record inside the shared mapping.
///
/// The header fields and the record checksum (header + payload) were
/// validated when the view was made. The payload bytes are read in place:
/// after using them, call [`is_intact`] (or use [`copy_to`]) to learn whether
/// the writer began overwriting them since.
///
/// [`is_intact`]: RecordView::is_intact
/// [`copy_to`]: RecordView::copy_to
pub struct RecordView<'a> {
    r: &'a RingReader,
    seq: u64,
    pos: u64,
    len: usize,
    meta: RecordMeta,
}

impl std::fmt::Debug for RecordView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordView")
            .field("seq", &self.seq)
            .field("len", &self.len)
            .field("meta", &self.meta)
            .finish()
    }
}

impl RecordView<'_> {
    /// The record's sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// The record's metadata (validated with the header).
    pub fn meta(&self) -> RecordMeta {
        self.meta
    }
    /// Pointer to the payload's first byte in the mapping (in bounds: asserted).
    fn payload_ptr(&self) -> *const u8 {
        self.r.m.payload_ptr(self.pos, self.len)
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload, in place (zero-copy).
    ///
    /// # Safety
    ///
    /// The bytes live in a shared mapping that the writer process rewrites once it laps this
    /// reader, so the returned slice can change while it is borrowed. The caller must treat
    /// everything read through it as untrusted and possibly torn: parse it defensively (no
    /// `unsafe` decisions based on it), and call [`is_intact`](Self::is_intact) *after* the
    /// last read; if that returns `false`, discard every result derived from the bytes. Use
    /// [`copy_to`](Self::copy_to) for a validated copy without these obligations.
    pub unsafe fn payload(&self) -> &[u8] {
        // SAFETY: in bounds (see `payload_ptr`); this process never writes the mapping (it is
        // mapped read-only), and the caller has accepted the torn-read contract above (the
        // same contract as Aeron's broadcast receiver and every seqlock).
        unsafe { std::slice::from_raw_parts(self.payload_ptr(), self.len) }
    }

    /// Re-check after consuming the payload. `false`: the writer began
    /// overwriting this record; discard what was read. The reader's position
    /// is then moved back to this record so that the next `next()` reports
    /// `Lapped` for it.
    pub fn is_intact(&self) -> bool {
        let ok = !self.r.truncated() && self.r.m.ring().intact(self.pos) && !self.r.truncated();
        if !ok && self.r.pos.get() > self.seq {
            self.r.pos.set(self.seq);
        }
        ok
    }
    /// Copy the payload into `out` (replacing its contents), then validate.
    /// `false`: lapped during the copy, `out` must be discarded.
    pub fn copy_to(&self, out: &mut Vec<u8>) -> bool {
        out.clear();
        out.reserve(self.len);
        // SAFETY: the source range is in bounds (`payload_ptr`), the destination has `len`
        // bytes of reserved capacity and does not overlap the mapping. The copy goes through
        // raw pointers (no reference to racing memory is formed); whether the writer touched
        // the bytes meanwhile is decided by `is_intact` below, before the caller sees them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.payload_ptr(), out.as_mut_ptr(), self.len);
            out.set_len(self.len);
        }
        self.is_intact()
    }
}
