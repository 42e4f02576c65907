//! The C ABI called in-process (through the rlib) against rings this test writes: every outcome
//! code of `kvb_next` with its `kvb_event` numbers (lap, ring reset, writer gone, empty), seek
//! errors, and NULL arguments answered with codes rather than crashes.

use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr;

use kvbridge_shm::{RecordMeta, RingWriter, WriterOptions};
use kvbridge_shm_c::*;

fn writer(path: &Path, capacity: usize) -> RingWriter {
    RingWriter::open(
        path,
        &WriterOptions {
            capacity,
            seq_base: Some(1),
            ..Default::default()
        },
    )
    .unwrap()
}

fn append(w: &mut RingWriter, len: usize, tag: u64) {
    let mut res = w.reserve(len).unwrap();
    res.buf().fill(tag as u8);
    res.commit(RecordMeta {
        upstream_seq: tag,
        ..Default::default()
    });
}

struct Reader(*mut kvb_reader);

impl Reader {
    fn open(path: &Path) -> Reader {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        let mut r = ptr::null_mut();
        // SAFETY: `c` is NUL-terminated and `r` is a writable pointer slot.
        assert_eq!(unsafe { kvb_open(c.as_ptr(), &mut r) }, KVB_OK);
        assert!(!r.is_null());
        Reader(r)
    }

    /// `kvb_next` → (status, record sequence or event, payload).
    fn next(&self, timeout_us: i64) -> (i32, kvb_event, Option<(u64, Vec<u8>)>) {
        let mut rec = kvb_record {
            sequence: 0,
            upstream_seq: 0,
            ingest_ns: 0,
            dp_rank: 0,
            flags: 0,
            payload: ptr::null(),
            len: 0,
        };
        let mut ev = kvb_event::default();
        // SAFETY: a live reader used by this thread only; `rec` and `ev` are writable.
        let st = unsafe { kvb_next(self.0, timeout_us, &mut rec, &mut ev) };
        let got = (st == KVB_OK).then(|| {
            // SAFETY: on KVB_OK `payload` points to `len` bytes owned by the reader, valid
            // until the next call on it; copied out right away.
            let p = unsafe { std::slice::from_raw_parts(rec.payload, rec.len) }.to_vec();
            (rec.sequence, p)
        });
        (st, ev, got)
    }

    fn window(&self) -> (u64, u64) {
        let (mut o, mut n) = (0, 0);
        // SAFETY: a live reader; both out-pointers are writable.
        assert_eq!(unsafe { kvb_window(self.0, &mut o, &mut n) }, KVB_OK);
        (o, n)
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        // SAFETY: opened by `kvb_open`, closed exactly once here.
        unsafe { kvb_close(self.0) };
    }
}

#[test]
fn lap_reports_missed_and_resume_at_then_reads_on() {
    let tmp = tempfile::tempdir().unwrap();
    let ring = tmp.path().join("ring");
    let mut w = writer(&ring, 64 * 1024);
    append(&mut w, 100, 1);
    let r = Reader::open(&ring);
    assert_eq!(r.window(), (1, 1));
    // Nothing new while the writer is alive: KVB_EMPTY after the timeout.
    let (st, _, got) = r.next(0);
    assert_eq!((st, got.map(|g| g.0)), (KVB_OK, Some(1)));
    assert_eq!(r.next(2_000).0, KVB_EMPTY);
    // 200 records of 1000 bytes overwrite the 64 KiB ring about three times.
    for i in 2..=201 {
        append(&mut w, 1000, i);
    }
    let oldest = w.oldest();
    assert!(oldest > 2);
    let (st, ev, _) = r.next(0);
    assert_eq!(st, KVB_LAPPED);
    assert_eq!((ev.resume_at, ev.missed), (oldest, oldest - 2));
    // SAFETY: a live reader.
    assert_eq!(unsafe { kvb_position(r.0) }, oldest);
    let (st, _, got) = r.next(0);
    assert_eq!(st, KVB_OK);
    let (seq, payload) = got.unwrap();
    assert_eq!(seq, oldest);
    assert_eq!(payload, vec![oldest as u8; 1000]);
    // Seek errors leave the position alone.
    // SAFETY: a live reader.
    unsafe {
        assert_eq!(kvb_seek(r.0, 1), KVB_ERR_SEEK_TOO_OLD);
        assert_eq!(kvb_seek(r.0, 203), KVB_ERR_SEEK_FUTURE);
        assert_eq!(kvb_position(r.0), oldest + 1);
        assert_eq!(kvb_seek(r.0, 202), KVB_OK);
    }
    // Writer closed: gone, positioned at N + 1.
    drop(w);
    let (st, ev, _) = r.next(-1);
    assert_eq!((st, ev.resume_at), (KVB_WRITER_GONE, 202));
}

#[test]
fn a_re_created_ring_is_a_ring_reset_with_the_new_id() {
    let tmp = tempfile::tempdir().unwrap();
    let ring = tmp.path().join("ring");
    let mut w = writer(&ring, 64 * 1024);
    append(&mut w, 10, 1);
    let r = Reader::open(&ring);
    assert_eq!(r.next(0).0, KVB_OK);
    drop(w);
    // Another capacity: the writer replaces the file (new ring id) instead of adopting it.
    let mut w = writer(&ring, 128 * 1024);
    append(&mut w, 10, 7);
    let (st, ev, _) = r.next(5_000_000);
    assert_eq!(st, KVB_RING_RESET);
    assert_eq!(ev.ring_id, w.ring_id());
    assert_eq!(ev.resume_at, w.oldest());
    let (st, _, got) = r.next(0);
    assert_eq!(st, KVB_OK);
    assert_eq!(got.unwrap().1, vec![7u8; 10]);
}

#[test]
fn null_and_bad_arguments_are_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = CString::new(tmp.path().join("nope").as_os_str().as_encoded_bytes()).unwrap();
    let not_a_ring = tmp.path().join("text");
    std::fs::write(&not_a_ring, vec![b'x'; 8192]).unwrap();
    let not_a_ring = CString::new(not_a_ring.as_os_str().as_encoded_bytes()).unwrap();
    let mut r = ptr::null_mut();
    // SAFETY: every pointer passed is NULL, a NUL-terminated string, or a writable slot.
    unsafe {
        assert_eq!(kvb_open(ptr::null(), &mut r), KVB_ERR_INVALID_ARGUMENT);
        assert_eq!(
            kvb_open(missing.as_ptr(), ptr::null_mut()),
            KVB_ERR_INVALID_ARGUMENT
        );
        assert_eq!(kvb_open(c"".as_ptr(), &mut r), KVB_ERR_INVALID_ARGUMENT);
        assert_eq!(kvb_open(missing.as_ptr(), &mut r), KVB_ERR_NOT_FOUND);
        assert!(r.is_null());
        assert_eq!(kvb_open(not_a_ring.as_ptr(), &mut r), KVB_ERR_NOT_A_RING);
        assert!(r.is_null());
        let mut ev = kvb_event::default();
        assert_eq!(
            kvb_next(ptr::null_mut(), 0, ptr::null_mut(), &mut ev),
            KVB_ERR_INVALID_ARGUMENT
        );
        assert_eq!(kvb_seek(ptr::null_mut(), 1), KVB_ERR_INVALID_ARGUMENT);
        assert_eq!(
            kvb_window(ptr::null_mut(), ptr::null_mut(), ptr::null_mut()),
            KVB_ERR_INVALID_ARGUMENT
        );
        assert_eq!(kvb_position(ptr::null_mut()), 0);
        kvb_close(ptr::null_mut());
    }
    for code in -9..=7 {
        // SAFETY: kvb_strerror returns a static NUL-terminated string for every code.
        let s = unsafe { CStr::from_ptr(kvb_strerror(code)) }
            .to_str()
            .unwrap();
        assert!(!s.is_empty());
    }
    assert_eq!(kvb_layout_version(), kvbridge_shm::layout::LAYOUT_VERSION);
}
