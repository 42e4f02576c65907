//! `kvbridge_shm._native`: the Python face of [`kvbridge_shm::RingReader`].
//!
//! This module adds no second implementation of the ring protocol (`shm/LAYOUT.md`): every read,
//! lap check, checksum, reset detection and futex wait is the crate's own code. What it adds is
//! the translation to Python:
//!
//! * a record is copied out of the mapping with [`RecordView::copy_to`], which validates the copy
//!   (intact + checksum) before Python sees a byte, and handed out as immutable `bytes`. A
//!   zero-copy `memoryview` over the mapping is deliberately not offered: the writer overwrites
//!   the bytes once it laps the reader, and Python code holding a view could not re-validate it
//!   after use, so it could act on torn data. The copy is a few hundred bytes per batch.
//! * lap, ring reset, writer gone and a damaged record become distinct exceptions carrying the
//!   numbers to resume from (the reader's position has already moved there);
//! * a read first tries the ring with the GIL held (a record is often already committed: no
//!   GIL round trip, no syscall); only when it finds nothing does it release the GIL
//!   (`Python::detach`) and wait in the crate's `next_blocking`, i.e. the same futex protocol
//!   as a Rust reader, but without its busy-spin by default (`spin_us = 0`: the reader sleeps
//!   on the futex at once and is woken by the commit; one `FUTEX_WAIT` per record it waits
//!   for). The wait runs in slices of at most 100 ms so that Ctrl-C (`KeyboardInterrupt`) is
//!   honoured; a slice only ends early on a timeout, never while records flow.
//!
//! The reader sits behind a mutex because a `#[pyclass]` must be shareable between Python
//! threads while `RingReader` keeps its position in a `Cell`. A second thread that calls into a
//! reader another thread is waiting on gets `RuntimeError` instead of blocking: blocking on the
//! mutex while holding the GIL could deadlock against the waiter, which needs the GIL back.
#![warn(missing_docs, unreachable_pub)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use kvbridge_shm::{ReadOutcome, RecordView, RingReader, SeekError, ShmError};
use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyPermissionError, PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    kvbridge_shm,
    RingError,
    PyException,
    "Base class of every kvbridge_shm error."
);
create_exception!(
    kvbridge_shm,
    Lapped,
    RingError,
    "The writer overwrote records this reader had not read yet. Attributes: `missed` (records \
     lost), `resume_at` (the next record the reader returns; it is already positioned there)."
);
create_exception!(
    kvbridge_shm,
    RingReset,
    RingError,
    "The ring file was re-created (new ring id). Attributes: `new_ring_id`, `resume_at` (the \
     reader switched to the new file and is positioned at its oldest record)."
);
create_exception!(
    kvbridge_shm,
    WriterGone,
    RingError,
    "Nothing to read and the writer process is gone (closed or killed). Attributes: \
     `resume_at` (the reader's position: a restarted writer continues the numbering, so reading \
     on after it is back returns exactly this record next)."
);
create_exception!(
    kvbridge_shm,
    CorruptRecord,
    RingError,
    "A retained record failed its checksum (its bytes were changed by something other than the \
     writer). It was skipped. Attributes: `seq`, `resume_at` (= seq + 1)."
);
create_exception!(
    kvbridge_shm,
    RingTruncated,
    RingError,
    "The ring file was truncated under this reader (someone shrank the file it maps). Without \
     this, the next read would have killed the process with SIGBUS. The reader reads nothing \
     more; open a new one once the writer has re-created the ring."
);
create_exception!(
    kvbridge_shm,
    SeekOutOfRange,
    RingError,
    "`seek(seq)` outside the retained window [oldest, newest + 1]. Attributes: `requested`, \
     `oldest`, `newest`."
);

/// Largest accepted `spin_us`: a spin is a short bridge over a wake-up, not a way to wait.
const MAX_SPIN_US: u64 = 1_000;

/// One slice of a wait: short enough to honour Ctrl-C and the `timeout` promptly.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// What one read produced, owned (no borrow of the mapping), so it can leave the GIL-free
/// section. The payload of a record is in the reader's scratch buffer.
enum Got {
    Record {
        seq: u64,
        meta: kvbridge_shm::RecordMeta,
    },
    Empty,
    Lapped {
        missed: u64,
        resume_at: u64,
    },
    Reset {
        new_ring_id: u64,
    },
    Gone,
    Corrupt {
        seq: u64,
        resume_at: u64,
    },
    Truncated,
}

struct Inner {
    reader: RingReader,
    /// Receives each payload; reused, so a steady stream allocates nothing here.
    scratch: Vec<u8>,
}

impl Inner {
    /// Read the next record, waiting up to `wait` (zero: poll once). A record the writer began
    /// overwriting during the copy is not returned; the crate then reports the lap on the next
    /// read, which this loop performs at once.
    fn take(&mut self, wait: Duration) -> Got {
        loop {
            let out = if wait.is_zero() {
                self.reader.next()
            } else {
                self.reader.next_blocking(wait)
            };
            let got = match out {
                ReadOutcome::Record(v) => match copy(&v, &mut self.scratch) {
                    Some(g) => g,
                    None => continue,
                },
                ReadOutcome::Empty => Got::Empty,
                ReadOutcome::Lapped { missed, resume_at } => Got::Lapped { missed, resume_at },
                ReadOutcome::RingReset { new_ring_id } => Got::Reset { new_ring_id },
                ReadOutcome::WriterGone => Got::Gone,
                ReadOutcome::Corrupt { seq, resume_at } => Got::Corrupt { seq, resume_at },
                ReadOutcome::Truncated => Got::Truncated,
            };
            return got;
        }
    }
}

/// Copy a record's payload into `out`; `None` when it was overwritten during the copy.
fn copy(v: &RecordView<'_>, out: &mut Vec<u8>) -> Option<Got> {
    v.copy_to(out).then(|| Got::Record {
        seq: v.seq(),
        meta: v.meta(),
    })
}

/// One batch read from the ring.
///
/// `payload` is the encoded `KvEventBatch` protobuf message, byte for byte what a gRPC
/// `SubscribeKvEvents` subscriber receives for the same sequence number. It was validated
/// (not overwritten, checksum matches) before it was handed out; it is an immutable copy.
#[pyclass(module = "kvbridge_shm", frozen, get_all)]
struct Record {
    /// The record's sequence number (the batch's `sequence_number`).
    sequence: u64,
    /// DP rank of the engine publisher the batch came from.
    dp_rank: u32,
    /// The engine's own sequence number of the batch.
    upstream_seq: u64,
    /// When kvbridge ingested the batch, nanoseconds since the Unix epoch.
    ingest_ns: u64,
    /// Writer-defined flags.
    flags: u32,
    /// The encoded `KvEventBatch`.
    payload: Py<PyBytes>,
}

#[pymethods]
impl Record {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Record(sequence={}, dp_rank={}, upstream_seq={}, ingest_ns={}, flags={}, payload=<{} bytes>)",
            self.sequence,
            self.dp_rank,
            self.upstream_seq,
            self.ingest_ns,
            self.flags,
            self.payload.bind(py).as_bytes().len()
        )
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.payload.bind(py).as_bytes().len()
    }
}

/// A read-only reader of one kvbridge ring file.
///
/// Opening maps the file read-only; the reader starts at the oldest retained record. Reading
/// never blocks the writer, and a reader can never modify the ring (it may only count itself
/// as a futex sleeper in the `<ring>.wake` side file).
///
/// `Reader(path, *, stale_after=1.0, spin_us=0)`: a read that finds nothing releases the GIL and
/// sleeps on the ring's futex until the writer's commit wakes it; `spin_us` (opt-in, ≤ 1000)
/// busy-polls that long first.
#[pyclass(module = "kvbridge_shm")]
struct Reader {
    inner: Mutex<Inner>,
    path: PathBuf,
}

fn open_err(e: ShmError) -> PyErr {
    match e {
        ShmError::NotFound { .. } => PyFileNotFoundError::new_err(e.to_string()),
        ShmError::PermissionDenied { .. } => PyPermissionError::new_err(e.to_string()),
        e => RingError::new_err(e.to_string()),
    }
}

/// An exception of type `E` with `attrs` set on the instance.
fn err_with<E: pyo3::PyTypeInfo>(py: Python<'_>, msg: String, attrs: &[(&str, u64)]) -> PyErr {
    let e = PyErr::new::<E, _>(msg);
    let v = e.value(py);
    for (k, x) in attrs {
        if let Err(set) = v.setattr(*k, *x) {
            return set;
        }
    }
    e
}

impl Reader {
    fn lock(&self) -> PyResult<MutexGuard<'_, Inner>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "this Reader is in use by another thread (give each thread its own Reader)",
            )),
            // A panic inside the crate while reading: the reader state is still consistent
            // (positions are plain numbers), so keep serving.
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        }
    }

    /// The next record, waiting up to `timeout` (`None`: without limit). `Ok(None)`: the
    /// timeout passed with nothing new.
    fn read(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Record>> {
        let mut g = self.lock()?;
        let inner = &mut *g;
        // Fast path with the GIL held when a record is already committed (one atomic load
        // decides): no GIL round trip, no syscall. Otherwise (or for a poll) the full read,
        // which also classifies an empty ring (writer gone, ring re-created).
        let committed = inner.reader.newest() >= inner.reader.position();
        let mut got = if committed || timeout == Some(Duration::ZERO) {
            inner.take(Duration::ZERO)
        } else {
            Got::Empty
        };
        // Empty or gone: wait (a writer restarting within the timeout is waited for).
        if matches!(got, Got::Empty | Got::Gone) && timeout != Some(Duration::ZERO) {
            let deadline = timeout.map(|t| Instant::now() + t);
            loop {
                let slice = match deadline {
                    Some(d) => d.saturating_duration_since(Instant::now()).min(WAIT_SLICE),
                    None => WAIT_SLICE,
                };
                // GIL released while the crate sleeps on the ring's futex (after a spin only
                // with `spin_us`).
                got = py.detach(|| inner.take(slice.max(Duration::from_micros(1))));
                let expired = deadline.is_some_and(|d| Instant::now() >= d);
                match got {
                    Got::Empty if !expired => {}
                    // Without a deadline, a gone writer is reported after one slice; with one,
                    // the crate keeps waiting for a restart until the slice ends, so report it
                    // only once the caller's timeout is spent.
                    Got::Gone if deadline.is_some() && !expired => {}
                    _ => break,
                }
                py.check_signals()?;
            }
        }
        let pos = inner.reader.position();
        match got {
            Got::Record { seq, meta } => Ok(Some(Record {
                sequence: seq,
                dp_rank: meta.dp_rank,
                upstream_seq: meta.upstream_seq,
                ingest_ns: meta.ingest_ns,
                flags: meta.flags,
                payload: PyBytes::new(py, &inner.scratch).unbind(),
            })),
            Got::Empty => Ok(None),
            Got::Lapped { missed, resume_at } => Err(err_with::<Lapped>(
                py,
                format!("lapped by the writer: {missed} records lost; resuming at {resume_at}"),
                &[("missed", missed), ("resume_at", resume_at)],
            )),
            Got::Reset { new_ring_id } => Err(err_with::<RingReset>(
                py,
                format!(
                    "ring {} was re-created (ring id {new_ring_id:#x}); resuming at its oldest record {pos}",
                    self.path.display()
                ),
                &[("new_ring_id", new_ring_id), ("resume_at", pos)],
            )),
            Got::Gone => Err(err_with::<WriterGone>(
                py,
                format!(
                    "the writer of {} is gone; next record is {pos} once it is back",
                    self.path.display()
                ),
                &[("resume_at", pos)],
            )),
            Got::Corrupt { seq, resume_at } => Err(err_with::<CorruptRecord>(
                py,
                format!("record {seq} is damaged (checksum); skipped, resuming at {resume_at}"),
                &[("seq", seq), ("resume_at", resume_at)],
            )),
            Got::Truncated => Err(RingTruncated::new_err(format!(
                "ring file {} was truncated under this reader; open a new reader once the writer has re-created it",
                self.path.display()
            ))),
        }
    }
}

fn timeout_arg(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s.min(1e9)))),
        Some(s) if s.is_infinite() && s > 0.0 => Ok(None),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be >= 0 seconds or None, not {s}"
        ))),
    }
}

#[pymethods]
impl Reader {
    /// Map the ring file at `path` read-only, positioned at the oldest retained record.
    ///
    /// `stale_after` (seconds): heartbeat age after which a writer whose pid cannot be checked
    /// (another pid namespace) is declared gone.
    ///
    /// `spin_us` (microseconds, default 0): how long a read that finds nothing busy-polls,
    /// GIL released, before it sleeps on the ring's futex. The default never spins: an idle
    /// reader costs no CPU and is woken by the writer's commit. A spin catches records that
    /// follow within that time without a wake-up, but takes a core while it lasts (on a
    /// busy host it takes it from the writer and the other readers).
    #[new]
    #[pyo3(signature = (path, *, stale_after = 1.0, spin_us = 0))]
    fn new(path: PathBuf, stale_after: f64, spin_us: u64) -> PyResult<Reader> {
        if spin_us > MAX_SPIN_US {
            return Err(PyValueError::new_err(format!(
                "spin_us must be <= {MAX_SPIN_US}, not {spin_us}"
            )));
        }
        let mut reader = RingReader::open(&path).map_err(open_err)?;
        let stale = timeout_arg(Some(stale_after))?.unwrap_or(Duration::from_secs(1));
        reader.set_stale_after(stale);
        reader.set_spin(Duration::from_micros(spin_us));
        Ok(Reader {
            inner: Mutex::new(Inner {
                reader,
                scratch: Vec::new(),
            }),
            path,
        })
    }

    /// `(oldest, newest)`: the retained window. `oldest == newest + 1` when the ring is empty.
    fn window(&self) -> PyResult<(u64, u64)> {
        let g = self.lock()?;
        let newest = g.reader.newest();
        Ok((g.reader.oldest().min(newest + 1), newest))
    }

    /// Position the reader so that the next record returned is `seq`.
    ///
    /// `seq` must be in `[oldest, newest + 1]` (`newest + 1`: the live tail, only new records);
    /// otherwise raises `SeekOutOfRange`.
    fn seek(&self, py: Python<'_>, seq: u64) -> PyResult<()> {
        let mut g = self.lock()?;
        g.reader.seek(seq).map_err(|e| {
            let (oldest, newest) = match e {
                SeekError::TooOld { oldest, newest, .. } => (oldest, newest),
                SeekError::Future { newest, .. } => (g.reader.oldest(), newest),
            };
            err_with::<SeekOutOfRange>(
                py,
                e.to_string(),
                &[("requested", seq), ("oldest", oldest), ("newest", newest)],
            )
        })
    }

    /// The sequence number the next read will try to return.
    #[getter]
    fn position(&self) -> PyResult<u64> {
        Ok(self.lock()?.reader.position())
    }

    /// The ring incarnation's random id (changes when the file is re-created).
    #[getter]
    fn ring_id(&self) -> PyResult<u64> {
        Ok(self.lock()?.reader.ring_id())
    }

    /// The ring file's path, as given to the constructor.
    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    /// Whether the writer process is alive (clean close: at once; killed: within ~250 ms).
    fn writer_alive(&self) -> PyResult<bool> {
        Ok(self.lock()?.reader.writer_alive())
    }

    /// The next record, waiting up to `timeout` seconds (`None`: until one arrives).
    ///
    /// Returns `None` when the timeout passes with nothing new. Raises `Lapped`, `RingReset`,
    /// `WriterGone` (only once the timeout is spent; without a timeout after ~100 ms with a dead
    /// writer) or `CorruptRecord`; after any of them the reader is positioned at `resume_at`
    /// and reading can simply go on. The GIL is released while waiting.
    #[pyo3(signature = (timeout = None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Record>> {
        self.read(py, timeout_arg(timeout)?)
    }

    /// Non-blocking read: the next record or `None`.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<Record>> {
        self.read(py, Some(Duration::ZERO))
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Iteration waits for each record without limit and raises like `next()`; it never ends
    /// by itself (stop with `break` or an exception).
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Record>> {
        self.read(py, None)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> bool {
        false
    }

    fn __repr__(&self) -> String {
        match self.lock() {
            Ok(g) => format!(
                "Reader(path={:?}, ring_id={:#x}, position={})",
                self.path.display().to_string(),
                g.reader.ring_id(),
                g.reader.position()
            ),
            Err(_) => format!("Reader(path={:?}, <busy>)", self.path.display().to_string()),
        }
    }
}

/// The compiled half of the `kvbridge_shm` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Reader>()?;
    m.add_class::<Record>()?;
    m.add("RingError", py.get_type::<RingError>())?;
    m.add("Lapped", py.get_type::<Lapped>())?;
    m.add("RingReset", py.get_type::<RingReset>())?;
    m.add("WriterGone", py.get_type::<WriterGone>())?;
    m.add("CorruptRecord", py.get_type::<CorruptRecord>())?;
    m.add("RingTruncated", py.get_type::<RingTruncated>())?;
    m.add("SeekOutOfRange", py.get_type::<SeekOutOfRange>())?;
    m.add("LAYOUT_VERSION", kvbridge_shm::layout::LAYOUT_VERSION)?;
    Ok(())
}
