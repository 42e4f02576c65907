#![allow(dead_code)]
use kvbridge_shm::*;
use std::path::PathBuf;

pub fn tmpdir() -> tempfile::TempDir {
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm"
    } else {
        "/tmp"
    };
    tempfile::Builder::new()
        .prefix("kvbshm-test")
        .tempdir_in(base)
        .unwrap()
}

pub fn ring_path(d: &tempfile::TempDir) -> PathBuf {
    d.path().join("test.ring")
}

pub fn opts(seq_base: u64) -> WriterOptions {
    WriterOptions {
        capacity: 64 * 1024,
        seq_base: Some(seq_base),
        group_read: false,
    }
}

pub fn meta(seq: u64) -> RecordMeta {
    RecordMeta {
        dp_rank: (seq % 4) as u32,
        upstream_seq: seq * 3,
        flags: (seq as u32).wrapping_mul(7),
        ingest_ns: seq * 1000,
        upstream_digest: (seq as u32) ^ 0xA5A5_0000,
    }
}

/// Deterministic payload for a sequence number.
pub fn payload(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seq.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

pub fn write(w: &mut RingWriter, len: usize) -> u64 {
    let seq = w.next_seq();
    let mut r = w.reserve(len).unwrap();
    assert_eq!(r.seq(), seq);
    r.buf().copy_from_slice(&payload(seq, len));
    r.commit(meta(seq));
    seq
}

/// Read one record and check it fully; returns its seq.
pub fn read_ok(r: &mut RingReader) -> u64 {
    match r.next() {
        ReadOutcome::Record(v) => {
            let seq = v.seq();
            assert_eq!(v.meta(), meta(seq));
            let mut got = Vec::new();
            assert!(v.copy_to(&mut got));
            assert_eq!(got, payload(seq, got.len()));
            seq
        }
        other => panic!("expected a record, got {other:?}"),
    }
}
