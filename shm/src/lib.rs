//! # kvbridge-shm: one writer, many read-only readers, one file in `/dev/shm`
//!
//! kvbridge turns an inference engine's KV-cache events into numbered
//! batches. Two kinds of consumers want them:
//!
//! * co-located processes, which should read a batch straight from memory,
//!   microseconds after ingest, without a socket and without a copy;
//! * the gRPC fan-out, which needs a *retained window* so that a client
//!   reconnecting with `start_sequence_number` resumes exactly where it was.
//!
//! One ring in shared memory serves both. The design borrows from Aeron's
//! broadcast buffer (a writer that never waits, readers that detect being
//! lapped with a "tail intent" counter), the LMAX Disruptor (sequence
//! numbers, cache-line-separated cursors) and iceoryx2 (shared-memory file
//! ownership, liveness). `LAYOUT.md` next to this crate is the byte-level
//! spec, precise enough for a C or Python reader.
//!
//! ## Why it is built this way
//!
//! * **The writer never blocks on readers.** Ingest must not stall because a
//!   subscriber is slow. So the writer simply overwrites; a reader that falls
//!   a full ring behind learns it was lapped ([`ReadOutcome::Lapped`]) and
//!   the gRPC layer turns that into `DATA_LOSS`. Silent skipping is the one
//!   thing the protocol rules out.
//! * **Readers cannot corrupt the ring.** They map the file `PROT_READ`. The
//!   only thing they write is a waiter count in a separate 4 KiB side file
//!   (`<ring>.wake`), because a futex sleeper must announce itself and a
//!   read-only mapping cannot (see `LAYOUT.md`, "Waiting").
//! * **Zero copy, but never a torn record.** A [`RecordView`] points into the
//!   mapping. Its header was validated against the overwrite horizon; the
//!   payload is re-validated by [`RecordView::is_intact`] after the consumer
//!   used it (seqlock / Aeron style).
//! * **A damaged record is reported, never served.** Every record carries a
//!   CRC32C of its header fields and payload, written at commit. A reader
//!   checks it *after* the intactness check, so bytes the writer overwrote
//!   mid-read are a lap, while bytes changed behind the writer's back (a
//!   stray write to the file, a bit flip) are [`ReadOutcome::Corrupt`]; the
//!   reader skips the record. The checksum detects accidents, not a party
//!   that can write the file and recompute it.
//! * **Numbers that survive restarts.** A restarted writer adopts the ring
//!   and continues at N + 1; a ring that must be re-created starts above any
//!   number an old client could hold (H + 2, or Unix µs), so an old cursor is
//!   classified as "too old" rather than landing in a different history
//!   (docs/smg-api.md §6.1).
//! * **One writer, enforced by the kernel.** `flock(LOCK_EX)` on the ring
//!   file; the kernel releases it when the writer dies, even by SIGKILL.
//! * **Proved, not hoped.** The publish / read / lap protocol lives in
//!   `protocol.rs` over an atomics shim, so `tests/loom.rs` model-checks the
//!   very code the file-backed ring runs.
//!
//! ## Quick start
//!
//! ```no_run
//! use kvbridge_shm::*;
//! use std::{path::Path, time::Duration};
//! let path = Path::new("/dev/shm/kvbridge-doc.ring");
//! let mut w = RingWriter::open(path, &WriterOptions { capacity: 1 << 20, ..Default::default() })?;
//! let mut res = w.reserve(5)?;
//! res.buf().copy_from_slice(b"hello");
//! res.commit(RecordMeta { dp_rank: 0, upstream_seq: 7, flags: 0, ingest_ns: 0, upstream_digest: 0 });
//!
//! let mut r = RingReader::open(path)?;
//! if let ReadOutcome::Record(v) = r.next_blocking(Duration::from_millis(10)) {
//!     let mut copy = Vec::new();
//!     assert!(v.copy_to(&mut copy));
//! }
//! # Ok::<(), ShmError>(())
//! ```

//! ## How it is tested
//!
//! * `tests/loom.rs` — loom model of publish / read / lap on a 128-byte ring
//!   (writer + 1 or 2 readers): no torn read, every lap reported and never
//!   spurious, monotonic sequence numbers, and an uncorrupted ring never
//!   reported corrupt (a checksum over half-overwritten bytes is a lap). Removing either the writer's
//!   Release fence or the reader's Acquire fence makes it fail.
//!   `RUSTFLAGS="--cfg loom" cargo test -p kvbridge-shm --release --test loom`
//! * `tests/multiprocess.rs` — a writer process and three reader processes
//!   (the test binary re-executed), checksummed payloads, the writer
//!   SIGKILLed mid-stream and restarted (adopts, continues at N + 1).
//! * `tests/boundary.rs`, `tests/props.rs` — wrap / padding edges, the
//!   largest record, adoption, re-creation, seek, modes, errors.
//! * `tests/integrity.rs` — bytes of a committed record flipped in the file:
//!   `Corrupt` (not `Lapped`) and the next record still readable; the
//!   checksum is the one `LAYOUT.md` specifies; the writer laps past a
//!   damaged header with a sane window; a file replaced at open says why
//!   ([`Replaced`]); a file truncated under the writer is found by
//!   [`RingWriter::check`] and nothing touches the mapping afterwards;
//!   [`remove_ring`] takes the `.wake` file along and [`remove_stale_files`]
//!   removes leftovers but nothing in use.
//! * `benches/append.rs` (criterion, vs memcpy) and `benches/latency.rs`
//!   (cross-process, HdrHistogram, busy-poll and futex readers).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]

/// The byte layout of `LAYOUT.md` as constants: offsets, sizes, magic numbers. Public because
/// they *are* the specification other-language readers implement against.
pub mod layout;
/// The publish / read / lap protocol over atomics. Public only to the loom model
/// (`--cfg loom`); everything else reaches it through [`RingWriter`] and [`RingReader`].
#[cfg(loom)]
pub mod protocol;
#[cfg(not(loom))]
#[allow(unreachable_pub)] // `pub` for the loom build above
mod protocol;
#[allow(unreachable_pub)] // `pub` for the loom build (std or loom atomics)
mod sync;

#[cfg(not(loom))]
mod error;
#[cfg(not(loom))]
mod fault;
#[cfg(not(loom))]
mod map;
#[cfg(not(loom))]
mod reader;
#[cfg(not(loom))]
mod sys;
#[cfg(not(loom))]
mod writer;

pub use protocol::{record_crc, RecordMeta};

#[cfg(not(loom))]
pub use error::{SeekError, ShmError};
#[cfg(not(loom))]
pub use reader::{ReadOutcome, RecordView, RingReader};
#[cfg(not(loom))]
pub use writer::{
    remove_ring, remove_stale_files, wake_path, Replaced, Reservation, RingWriter, StaleFile,
    WriterOptions,
};
