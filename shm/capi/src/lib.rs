//! # kvbridge-shm-capi: the ring reader behind a C ABI
//!
//! `include/kvbridge_shm.h` (generated from this file by cbindgen, checked by `tests/header.rs`)
//! lets C, C++ and Go (cgo) programs read kvbridge's shared-memory ring. Every function wraps
//! [`kvbridge_shm::RingReader`]: the bindings add no second implementation of the protocol of
//! `shm/LAYOUT.md` (validation, lap detection, checksum, ring-reset and writer liveness checks,
//! futex waiting are the crate's).
//!
//! ## Why the API looks like this
//!
//! * **Status codes, not errno.** Every call returns an `int32_t`: [`KVB_OK`], a positive
//!   *outcome* of reading ([`KVB_EMPTY`], [`KVB_LAPPED`], …; the reader stays usable and is
//!   already positioned to go on), or a negative *error*. `kvb_strerror` names each one.
//! * **Lap, reset, writer gone carry their numbers** in a [`kvb_event`] (`resume_at`, `missed`,
//!   `ring_id`, `seq`), so a C reader can account for lost records exactly as a Rust one.
//! * **The payload is a validated copy** in a buffer owned by the reader, valid until the next
//!   call on that reader. A pointer into the shared mapping would be cheaper, but the writer
//!   rewrites those bytes once it laps the reader and a C caller has no way to re-validate what
//!   it parsed; the copy is checked (not overwritten, CRC32C) before the call returns.
//! * **Opaque handle, one thread at a time.** A `kvb_reader` has a position; give each thread
//!   its own (opening is cheap, the mapping is read-only and shared by the kernel).
//! * **No panic crosses the boundary**: each entry point catches unwinding and returns
//!   [`KVB_ERR_PANIC`].
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs, unreachable_pub)]
#![allow(non_camel_case_types)] // C type names

use std::ffi::{c_char, CStr};
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

use kvbridge_shm::{ReadOutcome, RingReader, SeekError, ShmError};

/// Success: a record was read (`kvb_next`) or the call did what it says.
pub const KVB_OK: i32 = 0;
/// `kvb_next`: nothing new before the timeout (the writer is alive, or its state unknown).
pub const KVB_EMPTY: i32 = 1;
/// `kvb_next`: the writer overwrote records this reader had not read. `event.missed` records
/// were lost; the reader is positioned at `event.resume_at` (the oldest retained record).
pub const KVB_LAPPED: i32 = 2;
/// `kvb_next`: the ring file was re-created (`event.ring_id` is the new id). The reader switched
/// to the new file, positioned at its oldest record (`event.resume_at`).
pub const KVB_RING_RESET: i32 = 3;
/// `kvb_next`: nothing new and the writer is gone (closed or killed). `event.resume_at` is the
/// position; a restarted writer continues the numbering, so reading on returns it next.
pub const KVB_WRITER_GONE: i32 = 4;
/// `kvb_next`: record `event.seq` failed its checksum (changed by something other than the
/// writer) and was skipped; the reader is positioned at `event.resume_at` = seq + 1.
pub const KVB_CORRUPT: i32 = 5;
/// `kvb_next`: the ring file was truncated under this reader (someone shrank the file it maps;
/// without this the read would have been `SIGBUS`). The reader reads nothing more: every later
/// `kvb_next` returns this again. Close it and open a new reader once the writer has re-created
/// the ring.
pub const KVB_TRUNCATED: i32 = 6;
/// A required pointer argument was NULL, or the path is empty.
pub const KVB_ERR_INVALID_ARGUMENT: i32 = -1;
/// `kvb_open`: the ring file does not exist.
pub const KVB_ERR_NOT_FOUND: i32 = -2;
/// `kvb_open`: no permission to open the ring file.
pub const KVB_ERR_PERMISSION: i32 = -3;
/// `kvb_open`: the file is not a ring this library reads (magic, layout version, header).
pub const KVB_ERR_NOT_A_RING: i32 = -4;
/// `kvb_open`: another I/O error.
pub const KVB_ERR_IO: i32 = -5;
/// `kvb_seek`: the record was already overwritten (older than the oldest retained).
pub const KVB_ERR_SEEK_TOO_OLD: i32 = -6;
/// `kvb_seek`: the record does not exist yet (beyond newest + 1).
pub const KVB_ERR_SEEK_FUTURE: i32 = -7;
/// A Rust panic was caught at the boundary (a bug; the reader should be closed).
pub const KVB_ERR_PANIC: i32 = -8;

/// A reader of one ring file (opaque). Create with `kvb_open`, free with `kvb_close`.
pub struct kvb_reader {
    reader: RingReader,
    /// The last record's payload; `kvb_record.payload` points here.
    scratch: Vec<u8>,
}

/// One record, filled by `kvb_next` when it returns [`KVB_OK`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvb_record {
    /// Sequence number (the batch's `KvEventBatch.sequence_number`).
    pub sequence: u64,
    /// The engine's own sequence number of the batch.
    pub upstream_seq: u64,
    /// Ingest time, nanoseconds since the Unix epoch.
    pub ingest_ns: u64,
    /// DP rank of the engine publisher.
    pub dp_rank: u32,
    /// Writer-defined flags.
    pub flags: u32,
    /// The encoded `KvEventBatch` protobuf message (validated copy). Owned by the reader: valid
    /// until the next call on the same reader.
    pub payload: *const u8,
    /// Payload length in bytes.
    pub len: usize,
}

/// The numbers of a non-record outcome of `kvb_next` (fields not named by it are 0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvb_event {
    /// The next record the reader returns (its position after the outcome).
    pub resume_at: u64,
    /// [`KVB_LAPPED`]: records lost.
    pub missed: u64,
    /// [`KVB_RING_RESET`]: the new ring id.
    pub ring_id: u64,
    /// [`KVB_CORRUPT`]: the damaged record.
    pub seq: u64,
}

/// Runs `f`, turning a panic into [`KVB_ERR_PANIC`].
fn guard(f: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(KVB_ERR_PANIC)
}

fn open_code(e: &ShmError) -> i32 {
    match e {
        ShmError::NotFound { .. } => KVB_ERR_NOT_FOUND,
        ShmError::PermissionDenied { .. } => KVB_ERR_PERMISSION,
        ShmError::Io { .. } | ShmError::NoSpace { .. } => KVB_ERR_IO,
        _ => KVB_ERR_NOT_A_RING,
    }
}

/// Open the ring file at `path` (a NUL-terminated path) read-only and store a new reader in
/// `*out`, positioned at the oldest retained record. On error `*out` is set to NULL.
///
/// # Safety
///
/// `path` must be NULL or point to a NUL-terminated string; `out` must be NULL or point to
/// writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn kvb_open(path: *const c_char, out: *mut *mut kvb_reader) -> i32 {
    guard(|| {
        if path.is_null() || out.is_null() {
            return KVB_ERR_INVALID_ARGUMENT;
        }
        // SAFETY: `out` is non-null and, by the caller's contract, writable storage for a
        // pointer.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: non-null and NUL-terminated by the caller's contract; only read here.
        let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
        if bytes.is_empty() {
            return KVB_ERR_INVALID_ARGUMENT;
        }
        match RingReader::open(Path::new(std::ffi::OsStr::from_bytes(bytes))) {
            Ok(reader) => {
                let r = Box::new(kvb_reader {
                    reader,
                    scratch: Vec::new(),
                });
                // SAFETY: as above; ownership of the box passes to the caller until kvb_close.
                unsafe { out.write(Box::into_raw(r)) };
                KVB_OK
            }
            Err(e) => open_code(&e),
        }
    })
}

/// Free a reader (NULL is ignored). Its last record's payload becomes invalid.
///
/// # Safety
///
/// `r` must be NULL or a pointer returned by `kvb_open` that was not closed yet; it must not be
/// used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvb_close(r: *mut kvb_reader) {
    if !r.is_null() {
        // SAFETY: `r` came from `Box::into_raw` in `kvb_open` and, by the caller's contract, is
        // closed exactly once, so rebuilding the box frees it exactly once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(r) })));
    }
}

/// The reader behind `r`, or `None` for NULL.
///
/// # Safety
///
/// `r` is NULL or a live pointer from `kvb_open`, used by one thread at a time.
unsafe fn reader<'a>(r: *mut kvb_reader) -> Option<&'a mut kvb_reader> {
    // SAFETY: by the contract above the pointee is a live, exclusively used `kvb_reader`.
    unsafe { r.as_mut() }
}

/// Store the retained window: `*oldest` (the oldest retained record; `newest + 1` when the ring
/// is empty) and `*newest` (the newest published record).
///
/// # Safety
///
/// `r` must be a live reader from `kvb_open`, not used by another thread during the call;
/// `oldest` and `newest` must each be NULL (not stored) or writable.
#[no_mangle]
pub unsafe extern "C" fn kvb_window(r: *mut kvb_reader, oldest: *mut u64, newest: *mut u64) -> i32 {
    guard(|| {
        // SAFETY: caller's contract (see `reader`).
        let Some(k) = (unsafe { reader(r) }) else {
            return KVB_ERR_INVALID_ARGUMENT;
        };
        let n = k.reader.newest();
        let o = k.reader.oldest().min(n + 1);
        // SAFETY: each pointer is NULL (skipped by `as_mut`) or writable by the caller's
        // contract.
        unsafe {
            if let Some(p) = oldest.as_mut() {
                *p = o;
            }
            if let Some(p) = newest.as_mut() {
                *p = n;
            }
        }
        KVB_OK
    })
}

/// The sequence number the next `kvb_next` tries to return (0 when `r` is NULL).
///
/// # Safety
///
/// `r` must be NULL or a live reader from `kvb_open`, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn kvb_position(r: *mut kvb_reader) -> u64 {
    // SAFETY: caller's contract (see `reader`).
    unsafe { reader(r) }.map_or(0, |k| k.reader.position())
}

/// Make `seq` the next record. `seq` must be in `[oldest, newest + 1]` (`newest + 1`: the live
/// tail); otherwise [`KVB_ERR_SEEK_TOO_OLD`] or [`KVB_ERR_SEEK_FUTURE`] and the position is
/// unchanged.
///
/// # Safety
///
/// `r` must be a live reader from `kvb_open`, not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvb_seek(r: *mut kvb_reader, seq: u64) -> i32 {
    guard(|| {
        // SAFETY: caller's contract (see `reader`).
        let Some(k) = (unsafe { reader(r) }) else {
            return KVB_ERR_INVALID_ARGUMENT;
        };
        match k.reader.seek(seq) {
            Ok(()) => KVB_OK,
            Err(SeekError::TooOld { .. }) => KVB_ERR_SEEK_TOO_OLD,
            Err(SeekError::Future { .. }) => KVB_ERR_SEEK_FUTURE,
        }
    })
}

/// Longest single wait; a wait without limit is a loop of these (so a dead writer is reported).
const SLICE: Duration = Duration::from_millis(100);

/// Read the next record into `*rec`, waiting up to `timeout_us` microseconds for it (0: do not
/// wait; negative: no limit). Waiting spins ~20 µs, then sleeps on the ring's futex.
///
/// Returns [`KVB_OK`] (record in `*rec`), [`KVB_EMPTY`] (timeout), [`KVB_LAPPED`],
/// [`KVB_RING_RESET`], [`KVB_WRITER_GONE`], [`KVB_CORRUPT`] or [`KVB_TRUNCATED`] (final: the file
/// shrank under the reader); for `KVB_LAPPED` … `KVB_CORRUPT` `*event` (if
/// not NULL) holds the numbers and the reader is already positioned at `event->resume_at`, so
/// calling `kvb_next` again simply goes on. With a timeout, [`KVB_WRITER_GONE`] is returned
/// only once it has passed (a writer restarting meanwhile is waited for); without one, after
/// ~100 ms of a dead writer.
///
/// # Safety
///
/// `r` must be a live reader from `kvb_open`, not used by another thread during the call; `rec`
/// must be writable; `event` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvb_next(
    r: *mut kvb_reader,
    timeout_us: i64,
    rec: *mut kvb_record,
    event: *mut kvb_event,
) -> i32 {
    guard(|| {
        // SAFETY: caller's contract (see `reader`).
        let Some(k) = (unsafe { reader(r) }) else {
            return KVB_ERR_INVALID_ARGUMENT;
        };
        if rec.is_null() {
            return KVB_ERR_INVALID_ARGUMENT;
        }
        let deadline = (timeout_us >= 0)
            .then(|| Instant::now() + Duration::from_micros(timeout_us.unsigned_abs()));
        let mut ev = kvb_event::default();
        let code = loop {
            let wait = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
                None => SLICE,
            };
            let out = if wait.is_zero() {
                k.reader.next()
            } else {
                k.reader.next_blocking(wait)
            };
            let expired = deadline.is_none_or(|d| Instant::now() >= d);
            match out {
                ReadOutcome::Record(v) => {
                    if !v.copy_to(&mut k.scratch) {
                        // Overwritten during the copy: the next read reports the lap.
                        continue;
                    }
                    let m = v.meta();
                    let out = kvb_record {
                        sequence: v.seq(),
                        upstream_seq: m.upstream_seq,
                        ingest_ns: m.ingest_ns,
                        dp_rank: m.dp_rank,
                        flags: m.flags,
                        payload: k.scratch.as_ptr(),
                        len: k.scratch.len(),
                    };
                    // SAFETY: `rec` is non-null (checked) and writable by the caller's contract.
                    unsafe { rec.write(out) };
                    break KVB_OK;
                }
                ReadOutcome::Empty if deadline.is_none() || !expired => continue,
                ReadOutcome::Empty => break KVB_EMPTY,
                ReadOutcome::WriterGone if deadline.is_some() && !expired => continue,
                ReadOutcome::WriterGone => break KVB_WRITER_GONE,
                ReadOutcome::Lapped { missed, .. } => {
                    ev.missed = missed;
                    break KVB_LAPPED;
                }
                ReadOutcome::RingReset { new_ring_id } => {
                    ev.ring_id = new_ring_id;
                    break KVB_RING_RESET;
                }
                ReadOutcome::Corrupt { seq, .. } => {
                    ev.seq = seq;
                    break KVB_CORRUPT;
                }
                ReadOutcome::Truncated => break KVB_TRUNCATED,
            }
        };
        if code != KVB_OK {
            ev.resume_at = k.reader.position();
            // SAFETY: NULL (skipped by `as_mut`) or writable by the caller's contract.
            if let Some(p) = unsafe { event.as_mut() } {
                *p = ev;
            }
        }
        code
    })
}

/// A static, NUL-terminated description of a status code (never NULL).
#[no_mangle]
pub extern "C" fn kvb_strerror(code: i32) -> *const c_char {
    let s: &'static CStr = match code {
        KVB_OK => c"ok",
        KVB_EMPTY => c"no new record before the timeout",
        KVB_LAPPED => c"lapped by the writer: records lost, resuming at the oldest retained",
        KVB_RING_RESET => c"the ring file was re-created; resuming at its oldest record",
        KVB_WRITER_GONE => c"the writer is gone (closed or killed)",
        KVB_CORRUPT => c"a damaged record (checksum mismatch) was skipped",
        KVB_TRUNCATED => c"the ring file was truncated under this reader; open a new one",
        KVB_ERR_INVALID_ARGUMENT => c"invalid argument (NULL pointer or empty path)",
        KVB_ERR_NOT_FOUND => c"ring file does not exist",
        KVB_ERR_PERMISSION => c"no permission to open the ring file",
        KVB_ERR_NOT_A_RING => c"not a kvbridge ring of a layout version this library reads",
        KVB_ERR_IO => c"I/O error opening the ring file",
        KVB_ERR_SEEK_TOO_OLD => c"sequence is older than the retained window",
        KVB_ERR_SEEK_FUTURE => c"sequence is beyond newest + 1",
        KVB_ERR_PANIC => c"internal error (panic caught at the C boundary)",
        _ => c"unknown status code",
    };
    s.as_ptr()
}

/// The ring layout version this library reads (`shm/LAYOUT.md`).
#[no_mangle]
pub extern "C" fn kvb_layout_version() -> u32 {
    kvbridge_shm::layout::LAYOUT_VERSION
}
