#![cfg(not(loom))]
mod common;
use common::*;
use kvbridge_shm::layout::*;
use kvbridge_shm::*;
use std::os::unix::fs::FileExt;
use std::path::Path;

fn read_u64(f: &std::fs::File, off: u64) -> u64 {
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, off).unwrap();
    u64::from_le_bytes(b)
}

/// File offset of the first byte of record `seq` (through the index, as a reader finds it).
fn record_offset(path: &Path, seq: u64) -> u64 {
    let f = std::fs::File::open(path).unwrap();
    let slots = read_u64(&f, OFF_INDEX_SLOTS as u64);
    let index_off = read_u64(&f, OFF_INDEX_OFFSET as u64);
    let data_off = read_u64(&f, OFF_DATA_OFFSET as u64);
    let cap = read_u64(&f, OFF_CAPACITY as u64);
    let pos = read_u64(&f, index_off + 8 * (seq & (slots - 1)));
    data_off + (pos & (cap - 1))
}

/// Flip one bit of the byte at file offset `off`, through the file (not the writer).
fn flip(path: &Path, off: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, off).unwrap();
}

fn corrupt_then_read(field_off: u64) {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for _ in 0..5 {
        write(&mut w, 100);
    }
    let mut r = RingReader::open(&p).unwrap();
    flip(&p, record_offset(&p, 3) + field_off);
    assert_eq!(read_ok(&mut r), 1);
    assert_eq!(read_ok(&mut r), 2);
    match r.next() {
        ReadOutcome::Corrupt { seq, resume_at } => assert_eq!((seq, resume_at), (3, 4)),
        other => panic!("byte {field_off} of record 3 flipped: got {other:?}"),
    }
    assert_eq!(read_ok(&mut r), 4, "byte {field_off}");
    assert_eq!(read_ok(&mut r), 5, "byte {field_off}");
}

#[test]
fn corrupt_payload_byte_is_reported_not_served() {
    corrupt_then_read(RECORD_HEADER_LEN as u64 + 10);
}

#[test]
fn corrupt_header_byte_is_corrupt_not_lapped() {
    for off in [0u64, 8, 12, 16, 24, 28, 32, 36, REC_OFF_CRC as u64] {
        corrupt_then_read(off);
    }
}

/// The writer reads record headers back when it retires them; a corrupted one must not throw
/// its window off (an absurd `oldest`, or records overwritten while still announced).
fn writer_laps_past(field_byte: u64) {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for _ in 0..5 {
        write(&mut w, 100);
    }
    flip(&p, record_offset(&p, 3) + field_byte);
    for _ in 0..2 * 64 * 1024 / 100 {
        write(&mut w, 100);
    }
    let (o, n) = (w.oldest(), w.newest());
    assert!(
        n >= o && n - o > 100,
        "byte {field_byte}: window [{o}, {n}]"
    );
    let mut r = RingReader::open(&p).unwrap();
    assert_eq!(r.position(), o);
    for s in o..=n {
        assert_eq!(read_ok(&mut r), s, "byte {field_byte}");
    }
}

#[test]
fn writer_laps_past_a_corrupt_header() {
    writer_laps_past(7); // seq, top byte
    writer_laps_past(11); // len, top byte
    writer_laps_past(13); // kind
}

/// CRC-32C bit by bit, straight from its definition (reflected polynomial 0x82F63B78), as an
/// implementer of `LAYOUT.md` in another language would write it.
fn crc32c_reference(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// The stored checksum is what `LAYOUT.md` §4 says: CRC-32C over record bytes 0..40 as stored,
/// then the payload; the upstream digest beside it is stored as given.
#[test]
fn stored_checksum_matches_the_spec() {
    assert_eq!(crc32c_reference(b"123456789"), 0xE306_9283, "check value");
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for len in [0usize, 1, 7, 100, 1000] {
        let seq = write(&mut w, len);
        let off = record_offset(&p, seq);
        let f = std::fs::File::open(&p).unwrap();
        let mut rec = vec![0u8; RECORD_HEADER_LEN + len];
        f.read_exact_at(&mut rec, off).unwrap();
        let stored = u32::from_le_bytes(rec[REC_OFF_CRC..REC_OFF_CRC + 4].try_into().unwrap());
        let digest = u32::from_le_bytes(
            rec[REC_OFF_UPSTREAM_DIGEST..REC_OFF_UPSTREAM_DIGEST + 4]
                .try_into()
                .unwrap(),
        );
        let mut covered = rec[..RECORD_CRC_HEADER_LEN].to_vec();
        covered.extend_from_slice(&rec[RECORD_HEADER_LEN..]);
        assert_eq!(stored, crc32c_reference(&covered), "len {len}");
        assert_eq!(stored, record_crc(seq, len, &meta(seq), &payload(seq, len)));
        // The writer's note, stored as given and outside the checksum.
        assert_eq!(digest, meta(seq).upstream_digest);
    }
}

fn set_len(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// A ring with records 1..=5, its writer closed.
fn closed_ring(d: &tempfile::TempDir) -> std::path::PathBuf {
    let p = ring_path(d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for _ in 0..5 {
        write(&mut w, 100);
    }
    p
}

/// A file at the path that cannot be adopted is replaced, and the writer says why: damage
/// (truncation, not a ring, broken records) apart from a configuration or release change.
#[test]
fn replacement_at_start_up_names_the_reason() {
    let reopen = |p: &Path, cap: usize| {
        let w = RingWriter::open(
            p,
            &WriterOptions {
                capacity: cap,
                ..opts(1)
            },
        )
        .unwrap();
        assert!(!w.adopted());
        w.replaced().cloned().expect("a replaced file has a reason")
    };
    let damaged = |r: Replaced, want: &str| {
        assert!(r.is_damage(), "{r:?}");
        assert!(r.to_string().contains(want), "{r} should say {want:?}");
    };
    // Adopted, or nothing there: no reason.
    let d = tmpdir();
    let p = ring_path(&d);
    assert_eq!(RingWriter::open(&p, &opts(1)).unwrap().replaced(), None);
    let w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(w.adopted());
    assert_eq!(w.replaced(), None);
    drop(w);

    let d = tmpdir();
    let p = closed_ring(&d);
    let full = std::fs::metadata(&p).unwrap().len();
    set_len(&p, full / 2);
    damaged(
        reopen(&p, 64 * 1024),
        &format!("truncated: {} bytes", full / 2),
    );

    let d = tmpdir();
    let p = closed_ring(&d);
    set_len(&p, 100);
    damaged(reopen(&p, 64 * 1024), "truncated: 100 bytes");

    let d = tmpdir();
    let p = ring_path(&d);
    std::fs::write(&p, vec![0x41u8; 8192]).unwrap();
    damaged(reopen(&p, 64 * 1024), "not a kvbridge ring");

    let d = tmpdir();
    let p = closed_ring(&d);
    flip(&p, record_offset(&p, 3) + 7);
    damaged(reopen(&p, 64 * 1024), "records do not validate");

    let d = tmpdir();
    let p = closed_ring(&d);
    let r = reopen(&p, 128 * 1024);
    assert_eq!(
        r,
        Replaced::Capacity {
            found: 64 * 1024,
            requested: 128 * 1024
        }
    );
    assert!(!r.is_damage());

    let d = tmpdir();
    let p = closed_ring(&d);
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&1u32.to_le_bytes(), OFF_VERSION as u64)
        .unwrap();
    let r = reopen(&p, 64 * 1024);
    assert_eq!(r, Replaced::Version { found: 1 });
    assert!(!r.is_damage());
}

/// A ring file truncated under a live writer is found by `check` (an fstat, no access to the
/// mapping), after which the writer refuses to write and closes without touching the mapping.
#[test]
fn truncation_under_the_writer_is_detected_by_check() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    write(&mut w, 100);
    w.check().unwrap();
    w.heartbeat().unwrap();
    let full = std::fs::metadata(&p).unwrap().len();
    // Half the file: the header page stays, the data pages are gone (writing there is SIGBUS).
    set_len(&p, full / 2);
    match w.check() {
        Err(ShmError::Truncated { len, need, .. }) => assert_eq!((len, need), (full / 2, full)),
        other => panic!("{other:?}"),
    }
    let e = w.reserve(10).expect_err("no write after truncation");
    assert!(matches!(e, ShmError::Truncated { .. }), "{e:?}");
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(matches!(w.heartbeat(), Err(ShmError::Truncated { .. })));
    drop(w);
}

fn names_in(d: &tempfile::TempDir) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Writer, reader (which counts itself in the wake file while it sleeps), close, remove: nothing
/// of the ring is left, its wake file included.
#[test]
fn remove_ring_takes_the_wake_file_along() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    write(&mut w, 10);
    assert_eq!(read_ok(&mut r), 1);
    assert!(matches!(
        r.next_blocking(std::time::Duration::from_millis(5)),
        ReadOutcome::Empty
    ));
    assert_eq!(names_in(&d), ["test.ring", "test.ring.wake"]);
    drop(w);
    remove_ring(&p).unwrap();
    assert!(names_in(&d).is_empty(), "{:?}", names_in(&d));
    assert!(matches!(r.next(), ReadOutcome::WriterGone));
    remove_ring(&p).unwrap(); // already gone: fine
}

/// Leftovers are removed — a wake file whose ring is gone, a half-created ring whose creator
/// died — and nothing in use: a wake file beside its ring, a temporary file a live creator
/// holds locked, other files.
#[test]
fn stale_wake_and_tmp_files_are_removed() {
    let d = tmpdir();
    let p = ring_path(&d);
    let touch = |name: &str| std::fs::write(d.path().join(name), b"x").unwrap();
    // The ring was removed, its wake file stayed; a writer (pid beyond any pid_max) died while
    // creating it; another file merely shares the prefix.
    touch("test.ring.wake");
    touch("test.ring.tmp.2147483646.1f2e3d");
    touch("test.ring.tmp.notapid.1f2e3d");
    touch("test.ring2.wake");
    // A creator at work: its file is locked (this process, for the test, is the creator).
    let busy = d
        .path()
        .join(format!("test.ring.tmp.{}.abc", std::process::id()));
    std::fs::write(&busy, b"x").unwrap();
    let held = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&busy)
        .unwrap();
    // SAFETY: flock on a descriptor this test owns; no memory is passed.
    assert_eq!(
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) },
        0
    );
    let mut removed: Vec<String> = remove_stale_files(&p)
        .unwrap()
        .into_iter()
        .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    removed.sort();
    assert_eq!(
        removed,
        ["test.ring.tmp.2147483646.1f2e3d", "test.ring.wake"]
    );
    let busy_name = busy.file_name().unwrap().to_string_lossy().into_owned();
    let mut left = vec![
        busy_name.clone(),
        "test.ring.tmp.notapid.1f2e3d".to_string(),
        "test.ring2.wake".to_string(),
    ];
    left.sort();
    assert_eq!(names_in(&d), left);
    // The creator gone (lock released), its leftover is stale too.
    drop(held);
    let removed = remove_stale_files(&p).unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].path, busy);
    // A live ring keeps its wake file.
    let w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(remove_stale_files(&p).unwrap().is_empty());
    assert!(wake_path(&p).exists());
    drop(w);
}
