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
/// then the payload; the reserved word is 0.
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
        let reserved = u32::from_le_bytes(
            rec[REC_OFF_RESERVED..REC_OFF_RESERVED + 4]
                .try_into()
                .unwrap(),
        );
        let mut covered = rec[..RECORD_CRC_HEADER_LEN].to_vec();
        covered.extend_from_slice(&rec[RECORD_HEADER_LEN..]);
        assert_eq!(stored, crc32c_reference(&covered), "len {len}");
        assert_eq!(stored, record_crc(seq, len, &meta(seq), &payload(seq, len)));
        assert_eq!(reserved, 0);
    }
}
