//! The publish / read / lap protocol, independent of where the bytes live.
//!
//! Everything here operates on a [`Ring`]: references to the five cursor
//! words, the sequence index and the data area, all viewed as 64-bit atomic
//! words. The file-backed [`crate::RingWriter`] / [`crate::RingReader`] build a
//! `Ring` over the shared mapping; the loom model (`tests/loom.rs`) builds one
//! over a heap `Vec` of loom atomics, so the exact code that runs in production
//! is the code that loom checks.
//!
//! # Protocol in one paragraph
//!
//! Positions are monotonically increasing byte offsets (`u64`, never wrap in
//! practice); the physical offset is `pos & (cap - 1)`. To append, the writer
//! first moves `head`/`oldest` past every record the new one will overwrite,
//! then publishes the *overwrite horizon* `intent = end of the new record`
//! (Release store, then a Release fence), and only then touches data bytes.
//! It writes header and payload, then the index slot, then `tail` (Release)
//! and `newest` (Release). A reader loads `newest` and `tail` (Acquire), reads
//! the index slot and the record header, issues an Acquire fence and loads
//! `intent`: the record is valid iff it lies fully below `tail`, its header
//! names the wanted sequence number, and `intent <= pos + cap` (no byte of
//! the next lap over this record has been written yet). If any data word the
//! reader loaded came from a newer lap, the fence-fence synchronisation makes
//! the newer `intent` visible, so a torn read is always detected.

use crate::layout::*;
use crate::sync::{fence, AtomicU64, Ordering::*};

/// Views of the shared words. All slices are word (8 byte) granular.
pub struct Ring<'a> {
    /// Data capacity in bytes (power of two, multiple of 8).
    pub cap: u64,
    /// Index slots (power of two).
    pub slots: u64,
    /// Largest payload the writer accepts.
    pub max_payload: usize,
    pub tail: &'a AtomicU64,
    pub newest: &'a AtomicU64,
    pub intent: &'a AtomicU64,
    pub oldest: &'a AtomicU64,
    pub head: &'a AtomicU64,
    pub index: &'a [AtomicU64],
    pub data: &'a [AtomicU64],
}

/// Writer-private copy of the cursors (the writer is the only one that stores
/// them, so it never needs to load them back from shared memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterCursor {
    pub tail: u64,
    pub head: u64,
    pub oldest: u64,
    pub intent: u64,
    pub next_seq: u64,
}

/// A reserved, not yet committed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub seq: u64,
    /// Logical position of the record header.
    pub start: u64,
    /// Logical position one past the record (aligned).
    pub end: u64,
    pub len: usize,
}

/// Per-record metadata carried beside the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct RecordMeta {
    /// DP rank of the engine publisher this record came from.
    pub dp_rank: u32,
    /// The engine's own sequence number of the batch.
    pub upstream_seq: u64,
    /// Caller-defined flags.
    pub flags: u32,
    /// Ingest timestamp, nanoseconds since the Unix epoch.
    pub ingest_ns: u64,
    /// The writer's digest of the upstream input this record came from (0: none). Kept beside
    /// the checksum, not covered by it: it is the writer's own note, so that a restarted writer
    /// can tell which input it applied last; readers may ignore it.
    pub upstream_digest: u32,
}

/// Result of one read attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The record `want`, its header validated at the time of the call. The
    /// payload is not checked yet: checksum it, then call [`Ring::verify`].
    Record {
        pos: u64,
        len: usize,
        meta: RecordMeta,
        /// The checksum stored in the record header.
        crc: u32,
    },
    /// `want` has not been published yet.
    Empty,
    /// `want` is gone; `resume_at` (> want) is the oldest record that was
    /// still retained when the lap was detected.
    Lapped { resume_at: u64 },
    /// `want` is still retained (the writer has not retired it) but its bytes
    /// do not validate: something other than the writer changed the file.
    /// `resume_at` = want + 1.
    Corrupt { resume_at: u64 },
}

/// The record checksum: CRC32C (Castagnoli, as in iSCSI / ext4) over the
/// record's first [`RECORD_CRC_HEADER_LEN`] bytes as stored (seq, len, kind,
/// upstream_seq, dp_rank, flags, ingest_ns, little-endian), then its payload.
pub fn record_crc(seq: u64, len: usize, meta: &RecordMeta, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(record_crc_header(seq, len, meta), payload)
}

/// [`record_crc`] of the header alone: continue it over the payload with
/// `crc32c::crc32c_append` (in pieces, if the payload is read in pieces).
pub(crate) fn record_crc_header(seq: u64, len: usize, meta: &RecordMeta) -> u32 {
    let mut h = [0u8; RECORD_CRC_HEADER_LEN];
    h[REC_OFF_SEQ..REC_OFF_SEQ + 8].copy_from_slice(&seq.to_le_bytes());
    h[REC_OFF_LEN..REC_OFF_LEN + 4].copy_from_slice(&(len as u32).to_le_bytes());
    h[REC_OFF_KIND..REC_OFF_KIND + 4].copy_from_slice(&KIND_RECORD.to_le_bytes());
    h[REC_OFF_UPSTREAM_SEQ..REC_OFF_UPSTREAM_SEQ + 8]
        .copy_from_slice(&meta.upstream_seq.to_le_bytes());
    h[REC_OFF_DP_RANK..REC_OFF_DP_RANK + 4].copy_from_slice(&meta.dp_rank.to_le_bytes());
    h[REC_OFF_FLAGS..REC_OFF_FLAGS + 4].copy_from_slice(&meta.flags.to_le_bytes());
    h[REC_OFF_INGEST_NS..REC_OFF_INGEST_NS + 8].copy_from_slice(&meta.ingest_ns.to_le_bytes());
    crc32c::crc32c(&h)
}

impl std::fmt::Debug for Ring<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("cap", &self.cap)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl<'a> Ring<'a> {
    #[inline]
    fn mask(&self) -> u64 {
        self.cap - 1
    }

    #[inline]
    fn word(&self, pos: u64) -> &AtomicU64 {
        &self.data[((pos & self.mask()) >> 3) as usize]
    }

    #[inline]
    fn index_slot(&self, seq: u64) -> &AtomicU64 {
        &self.index[(seq & (self.slots - 1)) as usize]
    }

    /// Physical byte offset of the first payload byte of a record at `pos`.
    #[inline]
    pub fn payload_offset(&self, pos: u64) -> usize {
        ((pos & self.mask()) as usize) + RECORD_HEADER_LEN
    }

    /// Writer: make room for a record of `len` payload bytes and return its
    /// slot. Records the writer will overwrite stop being readable *before*
    /// this returns (oldest/head/intent are published first). The caller must
    /// have checked `len <= max_payload`.
    pub fn reserve(&self, cur: &mut WriterCursor, len: usize) -> Slot {
        debug_assert!(len <= self.max_payload);
        let size = record_size(len);
        let off = cur.tail & self.mask();
        let room = self.cap - off;
        // A record never straddles the end of the data area.
        let pad = if room < size { room } else { 0 };
        let start = cur.tail + pad;
        let end = start + size;
        // Retire every record that overlaps [end - cap, ..): those bytes are
        // about to be reused.
        while cur.head + self.cap < end {
            let h = cur.head;
            if h >= cur.tail {
                // Only reachable after a corrupted header (see below): everything
                // committed so far is retired.
                cur.head = start;
                cur.oldest = cur.oldest.max(cur.next_seq);
                break;
            }
            let hoff = h & self.mask();
            let hroom = self.cap - hoff;
            if hroom < RECORD_HEADER_LEN as u64 {
                cur.head = h + hroom;
                continue;
            }
            let w1 = self.word(h + 8).load(Relaxed);
            let (hlen, kind) = (w1 as u32 as usize, (w1 >> 32) as u32);
            if kind == KIND_PAD {
                cur.head = h + hroom;
                continue;
            }
            let seq = self.word(h).load(Relaxed);
            let size = record_size(hlen);
            if kind != KIND_RECORD
                || hlen > self.max_payload
                || hoff + size > self.cap
                || h + size > cur.tail
                || seq >= cur.next_seq
            {
                // Not a header this writer wrote: the file was modified behind
                // its back. Resynchronise at the next wrap, where a record
                // always starts, retiring everything before the record there.
                cur.head = h + hroom;
                if cur.head < cur.tail {
                    let s = self.word(cur.head).load(Relaxed);
                    if s < cur.next_seq {
                        cur.oldest = cur.oldest.max(s);
                    }
                }
                continue;
            }
            cur.head = h + size;
            cur.oldest = cur.oldest.max(seq + 1);
        }
        let seq = cur.next_seq;
        // The index slot of `seq - slots` is reused by `seq`.
        cur.oldest = cur.oldest.max((seq + 1).saturating_sub(self.slots));
        cur.intent = cur.intent.max(end);
        self.oldest.store(cur.oldest, Relaxed);
        self.head.store(cur.head, Relaxed);
        self.intent.store(cur.intent, Release);
        // Orders the stores above before every data store below: a reader that
        // sees any of the new data also sees the new intent (fence-fence sync).
        fence(Release);
        if pad >= RECORD_HEADER_LEN as u64 {
            self.word(cur.tail).store(0, Relaxed);
            let w1 = (pad - RECORD_HEADER_LEN as u64) | ((KIND_PAD as u64) << 32);
            self.word(cur.tail + 8).store(w1, Relaxed);
        }
        self.word(start).store(seq, Relaxed);
        self.word(start + 8)
            .store(len as u64 | ((KIND_RECORD as u64) << 32), Relaxed);
        Slot {
            seq,
            start,
            end,
            len,
        }
    }

    /// Writer: publish a reserved record (payload already written). `crc` is
    /// [`record_crc`] of the record as committed.
    pub fn commit(&self, cur: &mut WriterCursor, slot: Slot, meta: RecordMeta, crc: u32) {
        debug_assert_eq!(slot.seq, cur.next_seq);
        self.word(slot.start + 16).store(meta.upstream_seq, Relaxed);
        self.word(slot.start + 24)
            .store(meta.dp_rank as u64 | ((meta.flags as u64) << 32), Relaxed);
        self.word(slot.start + 32).store(meta.ingest_ns, Relaxed);
        // crc u32 | upstream_digest u32.
        self.word(slot.start + REC_OFF_CRC as u64)
            .store(crc as u64 | ((meta.upstream_digest as u64) << 32), Relaxed);
        self.index_slot(slot.seq).store(slot.start, Relaxed);
        self.tail.store(slot.end, Release);
        self.newest.store(slot.seq, Release);
        cur.tail = slot.end;
        cur.next_seq = slot.seq + 1;
    }

    /// Reader: try to read record `want`.
    pub fn read(&self, want: u64) -> Read {
        let newest = self.newest.load(Acquire);
        if want > newest {
            return Read::Empty;
        }
        let tail = self.tail.load(Acquire);
        let pos = self.index_slot(want).load(Relaxed);
        let hdr = RECORD_HEADER_LEN as u64;
        let off = pos & self.mask();
        // Structural checks first so that garbage never indexes out of bounds.
        let mut ok = pos < tail && tail - pos <= self.cap && pos % 8 == 0 && self.cap - off >= hdr;
        let mut len = 0usize;
        let mut meta = RecordMeta::default();
        let mut crc = 0;
        if ok {
            let seq = self.word(pos).load(Relaxed);
            let w1 = self.word(pos + 8).load(Relaxed);
            let up = self.word(pos + 16).load(Relaxed);
            let w3 = self.word(pos + 24).load(Relaxed);
            let ts = self.word(pos + 32).load(Relaxed);
            let w5 = self.word(pos + REC_OFF_CRC as u64).load(Relaxed);
            crc = w5 as u32;
            len = (w1 as u32) as usize;
            let size = record_size(len);
            ok = seq == want
                && (w1 >> 32) as u32 == KIND_RECORD
                && len <= self.max_payload
                && off + size <= self.cap
                && pos + size <= tail;
            meta = RecordMeta {
                dp_rank: w3 as u32,
                upstream_seq: up,
                flags: (w3 >> 32) as u32,
                ingest_ns: ts,
                upstream_digest: (w5 >> 32) as u32,
            };
        }
        // Always fence + load intent, also on failure: the fence is what makes
        // the `oldest` store that preceded a newer index/data word visible.
        let intact = self.intact(pos);
        if ok && intact {
            return Read::Record {
                pos,
                len,
                meta,
                crc,
            };
        }
        self.lost(want)
    }

    /// Reader: `want` (≤ newest) failed validation. Lapped if the writer has
    /// retired it, else corrupt. The writer publishes `oldest > want` before
    /// it reuses anything `want` occupies (data bytes, index slot) and before
    /// the `intent` and `tail` that make a check fail, and the reader has
    /// fenced (Acquire) after its loads, so a failure the writer caused always
    /// comes with a visible `oldest > want`: a failure without one means the
    /// bytes were changed by someone else. `tests/loom.rs` asserts that an
    /// uncorrupted ring never yields `Corrupt`.
    fn lost(&self, want: u64) -> Read {
        let oldest = self.oldest.load(Acquire);
        if oldest > want {
            Read::Lapped { resume_at: oldest }
        } else {
            Read::Corrupt {
                resume_at: want + 1,
            }
        }
    }

    /// Reader: after checksumming the payload of a [`Read::Record`] `want` at
    /// `pos` (`crc_ok`: [`record_crc`] matched its stored checksum). `Ok`: the
    /// record is good. A mismatch counts as corruption only if the record is
    /// still intact afterwards; a record the writer began overwriting while
    /// it was being checksummed is a lap, whatever the checksum said.
    pub fn verify(&self, want: u64, pos: u64, crc_ok: bool) -> Result<(), Read> {
        if !self.intact(pos) {
            return Err(self.lost(want));
        }
        if crc_ok {
            Ok(())
        } else {
            Err(Read::Corrupt {
                resume_at: want + 1,
            })
        }
    }

    /// Reader: after loading anything of the record at `pos`, is it still
    /// the record that was validated (no byte of it overwritten yet)?
    #[inline]
    pub fn intact(&self, pos: u64) -> bool {
        // Pairs with the writer's Release fence in `reserve`.
        fence(Acquire);
        self.intent.load(Acquire) <= pos.saturating_add(self.cap)
    }

    /// Writer: the data word at logical position `pos` (loom model payloads).
    #[cfg(loom)]
    pub fn data_word(&self, pos: u64) -> &AtomicU64 {
        self.word(pos)
    }
}
