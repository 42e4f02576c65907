//! Byte offsets of the ring file. `LAYOUT.md` is the normative description;
//! these constants are its machine-readable twin.

/// `b"KVBRSHM1"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVBRSHM1");
/// Bumped on any incompatible change of this file's layout or protocol.
pub const LAYOUT_VERSION: u32 = 2;
/// Size of the header block; the index starts right after it.
pub const HEADER_LEN: u64 = 4096;

// --- line 0: immutable after creation -------------------------------------
/// u64 [`MAGIC`].
pub const OFF_MAGIC: usize = 0;
/// u32 [`LAYOUT_VERSION`].
pub const OFF_VERSION: usize = 8;
/// u32 [`HEADER_LEN`].
pub const OFF_HEADER_LEN: usize = 12;
/// u64 random id of this ring incarnation (readers detect a replaced ring by it).
pub const OFF_RING_ID: usize = 16;
/// u64 data-area size in bytes (a power of two).
pub const OFF_CAPACITY: usize = 24;
/// u64 number of seq → position index slots.
pub const OFF_INDEX_SLOTS: usize = 32;
/// u64 file offset of the index.
pub const OFF_INDEX_OFFSET: usize = 40;
/// u64 file offset of the data area.
pub const OFF_DATA_OFFSET: usize = 48;
/// u64 first sequence number of this ring.
pub const OFF_SEQ_BASE: usize = 56;
// --- line 1: writer identity and liveness ----------------------------------
/// u32 writer pid; 0 = no writer (clean close).
pub const OFF_WRITER_PID: usize = 64;
/// u32 `STATE_*`.
pub const OFF_STATE: usize = 68;
/// u64 writer heartbeat (coarse monotonic clock, ns).
pub const OFF_HEARTBEAT_NS: usize = 72;
/// u64 inode of the writer's pid namespace (liveness checks by pid only within it).
pub const OFF_PIDNS_INO: usize = 80;
/// u64 creation time (Unix ns).
pub const OFF_CREATED_NS: usize = 88;
/// u64 largest payload accepted ([`max_payload`]).
pub const OFF_MAX_PAYLOAD: usize = 96;
// --- cursors, one cache line each ------------------------------------------
/// u64 tail: logical end of the last committed record.
pub const OFF_TAIL: usize = 128;
/// u64 newest committed sequence number (N).
pub const OFF_NEWEST: usize = 192;
/// u64 intent: logical end of the bytes the writer may be overwriting (readers validate against it).
pub const OFF_INTENT: usize = 256;
/// u64 oldest retained sequence number (O).
pub const OFF_OLDEST: usize = 320;
/// u64 head: logical start of the oldest retained record.
pub const OFF_HEAD: usize = 384;
/// u32 futex word bumped on commit when readers wait.
pub const OFF_NOTIFY: usize = 448;
// --- writer notes: the writer's own, readers ignore them (LAYOUT.md §3.1) ----
/// u64 notes control word: bits 0..32 the number of notes in the active area, bit 32 which
/// area (0: [`OFF_NOTES_A`], 1: [`OFF_NOTES_B`]) is active.
pub const OFF_NOTES_CTL: usize = 512;
/// Size of one writer note in bytes.
pub const NOTE_LEN: usize = 16;
/// Notes one area holds.
pub const NOTES_MAX: usize = 110;
/// First note area.
pub const OFF_NOTES_A: usize = 576;
/// Second note area.
pub const OFF_NOTES_B: usize = OFF_NOTES_A + NOTES_MAX * NOTE_LEN;
const _: () = assert!(OFF_NOTES_B + NOTES_MAX * NOTE_LEN <= HEADER_LEN as usize);

/// The ring has (or had) a live writer.
pub const STATE_ACTIVE: u32 = 0;
/// Set in the *old* file by a writer that replaced it with a new ring.
pub const STATE_RETIRED: u32 = 1;

// --- records -----------------------------------------------------------------
/// Record header: seq u64 | len u32, kind u32 | upstream_seq u64 |
/// dp_rank u32, flags u32 | ingest_ns u64 | crc u32, upstream_digest u32.
pub const RECORD_HEADER_LEN: usize = 48;
/// u64 in a record: its sequence number (0 in padding).
pub const REC_OFF_SEQ: usize = 0;
/// u32 in a record: payload length.
pub const REC_OFF_LEN: usize = 8;
/// u32 in a record: [`KIND_RECORD`] or [`KIND_PAD`].
pub const REC_OFF_KIND: usize = 12;
/// u64 in a record: the engine's sequence number.
pub const REC_OFF_UPSTREAM_SEQ: usize = 16;
/// u32 in a record: DP rank.
pub const REC_OFF_DP_RANK: usize = 24;
/// u32 in a record: caller-defined flags.
pub const REC_OFF_FLAGS: usize = 28;
/// u64 in a record: ingest time (Unix ns).
pub const REC_OFF_INGEST_NS: usize = 32;
/// u32 in a record: CRC32C of the record's first [`RECORD_CRC_HEADER_LEN`] bytes followed by
/// its payload (see `record_crc`). Written at commit; checked by readers.
pub const REC_OFF_CRC: usize = 40;
/// u32 in a record: the writer's digest of the upstream input the record came from (kvbridge:
/// the engine batch's bytes; 0 = none), not covered by the checksum. Readers need not look at
/// it; a writer uses it to tell, after a restart, what it applied last (LAYOUT.md §4).
pub const REC_OFF_UPSTREAM_DIGEST: usize = 44;
/// Header bytes covered by the record checksum: every field before [`REC_OFF_CRC`].
pub const RECORD_CRC_HEADER_LEN: usize = 40;
/// Records start at multiples of this.
pub const RECORD_ALIGN: usize = 8;
/// Record kind: a payload record.
pub const KIND_RECORD: u32 = 1;
/// Record kind: padding up to the end of the data area (wrap).
pub const KIND_PAD: u32 = 2;

// --- wake side file ----------------------------------------------------------
/// `b"KVBWAKE1"` read as a little-endian u64.
pub const WAKE_MAGIC: u64 = u64::from_le_bytes(*b"KVBWAKE1");
/// Size of the wake side file.
pub const WAKE_LEN: u64 = 4096;
/// u32 number of readers waiting on the futex.
pub const WAKE_OFF_WAITERS: usize = 64;

/// Smallest data capacity accepted (64 KiB).
pub const MIN_CAPACITY: usize = 64 * 1024;
/// One index slot per this many data bytes.
pub const BYTES_PER_INDEX_SLOT: usize = 128;

/// `v` rounded up to a multiple of `a` (a power of two).
pub const fn align_up(v: u64, a: u64) -> u64 {
    (v + a - 1) & !(a - 1)
}

/// Bytes a record with `len` payload bytes occupies in the data area.
pub const fn record_size(len: usize) -> u64 {
    align_up((RECORD_HEADER_LEN + len) as u64, RECORD_ALIGN as u64)
}

/// Largest payload a ring of `capacity` data bytes accepts: a record may use
/// at most a quarter of the ring, so that a reader that just read a record is
/// never lapped by the single next append (Aeron's broadcast buffer uses 1/8).
pub const fn max_payload(capacity: u64) -> usize {
    (capacity / 4) as usize - RECORD_HEADER_LEN
}

/// Index slots for a data capacity (power of two because capacity is).
pub const fn index_slots(capacity: u64) -> u64 {
    let s = capacity / BYTES_PER_INDEX_SLOT as u64;
    if s < 64 {
        64
    } else {
        s
    }
}
