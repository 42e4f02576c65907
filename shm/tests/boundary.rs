#![cfg(not(loom))]
mod common;
use common::*;
use kvbridge_shm::layout::*;
use kvbridge_shm::*;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

#[test]
fn roundtrip_and_numbering() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(!w.adopted());
    assert_eq!((w.oldest(), w.newest(), w.next_seq()), (1, 0, 1));
    let mut r = RingReader::open(&p).unwrap();
    assert_eq!(r.ring_id(), w.ring_id());
    assert!(matches!(r.next(), ReadOutcome::Empty));
    for i in 1..=10 {
        assert_eq!(write(&mut w, 100 + i as usize), i);
    }
    for i in 1..=10 {
        assert_eq!(read_ok(&mut r), i);
    }
    assert!(matches!(r.next(), ReadOutcome::Empty));
    assert_eq!((r.oldest(), r.newest()), (1, 10));
    assert_eq!((w.oldest(), w.newest()), (1, 10));
}

#[test]
fn dropped_reservation_publishes_nothing() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    write(&mut w, 10);
    {
        let mut res = w.reserve(300).unwrap();
        assert_eq!(res.seq(), 2);
        res.buf().fill(0xAA);
    }
    assert!(matches!(r.next(), ReadOutcome::Record(_)));
    assert!(matches!(r.next(), ReadOutcome::Empty));
    assert_eq!(w.next_seq(), 2);
    assert_eq!(write(&mut w, 20), 2);
    assert_eq!(read_ok(&mut r), 2);
}

#[test]
fn record_ends_exactly_at_wrap() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    let len = 4096 - RECORD_HEADER_LEN; // 16 records fill 64 KiB exactly
    for i in 1..=48u64 {
        write(&mut w, len);
        if i % 16 == 0 {
            assert_eq!(
                w.cursor().tail,
                i / 16 * 65536,
                "record ends at the wrap point"
            );
        }
        assert_eq!(read_ok(&mut r), i);
    }
    // The ring holds exactly 16 such records.
    assert_eq!((w.oldest(), w.newest()), (33, 48));
    let mut r2 = RingReader::open(&p).unwrap();
    assert_eq!(r2.position(), 33);
    for i in 33..=48 {
        assert_eq!(read_ok(&mut r2), i);
    }
}

#[test]
fn padding_and_implicit_skip_at_wrap() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    // Records of 5040 bytes: 13 * 5040 = 65520, 16 bytes left, less than a header -> implicit skip.
    let l = 5040 - RECORD_HEADER_LEN;
    for _ in 0..13 {
        write(&mut w, l);
    }
    assert_eq!(w.cursor().tail, 65520);
    let s = write(&mut w, l);
    assert_eq!(w.cursor().tail, 65536 + 5040, "skipped the 16-byte tail");
    // Now leave 1000 bytes before the next wrap, then write 2000: padding record.
    while 131072 - w.cursor().tail >= 5040 {
        write(&mut w, l);
    }
    let left = 131072 - w.cursor().tail;
    // A record 500 bytes longer than what is left (`left` may be shorter than a header).
    let len = (left as usize + 500) - RECORD_HEADER_LEN;
    write(&mut w, len);
    assert_eq!(w.cursor().tail, 131072 + record_size(len));
    let mut seen = 0;
    loop {
        match r.next() {
            ReadOutcome::Record(v) => {
                let mut got = Vec::new();
                assert!(v.copy_to(&mut got));
                assert_eq!(got, payload(v.seq(), got.len()));
                seen += 1;
            }
            ReadOutcome::Lapped { missed, resume_at } => {
                assert!(missed > 0 && resume_at > s);
            }
            ReadOutcome::Empty => break,
            o => panic!("{o:?}"),
        }
    }
    assert!(seen >= 10);
    assert_eq!(r.position(), w.next_seq());
}

#[test]
fn largest_record_and_too_large() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let max = w.max_record_len();
    assert_eq!(max, 65536 / 4 - RECORD_HEADER_LEN);
    let mut r = RingReader::open(&p).unwrap();
    for i in 1..=9 {
        write(&mut w, max);
        assert_eq!(read_ok(&mut r), i);
    }
    match w.reserve(max + 1) {
        Err(ShmError::RecordTooLarge { len, max: m }) => assert_eq!((len, m), (max + 1, max)),
        o => panic!("{o:?}"),
    }
    match w.reserve(1 << 20) {
        Err(ShmError::RecordTooLarge { .. }) => {}
        o => panic!("{o:?}"),
    }
    // The failed reservations consumed nothing.
    assert_eq!(write(&mut w, 0), 10);
    assert_eq!(read_ok(&mut r), 10);
}

#[test]
fn lapped_reader_is_told_and_resumes_at_oldest() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    for _ in 0..200 {
        write(&mut w, 1000);
    }
    let o = w.oldest();
    assert!(o > 1);
    match r.next() {
        ReadOutcome::Lapped { missed, resume_at } => {
            assert_eq!(resume_at, o);
            assert_eq!(missed, o - 1);
        }
        x => panic!("{x:?}"),
    }
    assert_eq!(r.position(), o);
    assert_eq!(read_ok(&mut r), o);
}

#[test]
fn view_overwritten_while_held_is_not_intact() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    write(&mut w, 1000);
    {
        let v = match r.next() {
            ReadOutcome::Record(v) => v,
            o => panic!("{o:?}"),
        };
        assert!(v.is_intact());
        for _ in 0..100 {
            write(&mut w, 1000);
        }
        assert!(!v.is_intact());
        let mut buf = Vec::new();
        assert!(!v.copy_to(&mut buf));
    }
    match r.next() {
        ReadOutcome::Lapped { missed, resume_at } => {
            assert_eq!(resume_at, w.oldest());
            assert_eq!(missed, resume_at - 1);
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn index_window_bounds_oldest() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let slots = index_slots(65536);
    for _ in 0..(slots * 3) {
        write(&mut w, 0);
    }
    assert_eq!(w.oldest(), w.newest() + 1 - slots);
    let mut r = RingReader::open(&p).unwrap();
    assert_eq!(r.oldest(), w.oldest());
    for s in w.oldest()..=w.newest() {
        assert_eq!(read_ok(&mut r), s);
    }
}

#[test]
fn seek_too_old_future_head() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for _ in 0..200 {
        write(&mut w, 1000);
    }
    let (o, n) = (w.oldest(), w.newest());
    let mut r = RingReader::open(&p).unwrap();
    assert_eq!(
        r.seek(o - 1),
        Err(SeekError::TooOld {
            requested: o - 1,
            oldest: o,
            newest: n
        })
    );
    assert_eq!(
        r.seek(0).unwrap_err(),
        SeekError::TooOld {
            requested: 0,
            oldest: o,
            newest: n
        }
    );
    assert_eq!(
        r.seek(n + 2),
        Err(SeekError::Future {
            requested: n + 2,
            newest: n
        })
    );
    r.seek(n + 1).unwrap(); // at head: live tail
    assert!(matches!(r.next(), ReadOutcome::Empty));
    write(&mut w, 5);
    assert_eq!(read_ok(&mut r), n + 1);
    let o = w.oldest();
    r.seek(o).unwrap();
    assert_eq!(read_ok(&mut r), o);
    r.seek(n).unwrap();
    assert_eq!(read_ok(&mut r), n);
}

#[test]
fn adoption_after_restart_continues_n_plus_1() {
    let d = tmpdir();
    let p = ring_path(&d);
    let id;
    {
        let mut w = RingWriter::open(&p, &opts(1)).unwrap();
        id = w.ring_id();
        for _ in 0..50 {
            write(&mut w, 700);
        }
        // an uncommitted reservation at the moment of "death"
        let mut res = w.reserve(900).unwrap();
        res.buf().fill(0xFF);
        // "dies" mid-record: the reservation is never committed
    }
    let mut r = RingReader::open(&p).unwrap();
    let o = r.oldest();
    let mut w = RingWriter::open(
        &p,
        &WriterOptions {
            seq_base: None,
            ..opts(1)
        },
    )
    .unwrap();
    assert!(w.adopted());
    assert_eq!(w.ring_id(), id);
    assert_eq!(w.next_seq(), 51);
    assert_eq!(w.oldest(), o);
    assert_eq!(write(&mut w, 700), 51);
    for s in r.position()..=51 {
        assert_eq!(read_ok(&mut r), s);
    }
}

#[test]
fn recreate_on_bad_magic_and_high_water() {
    let d = tmpdir();
    let p = ring_path(&d);
    std::fs::write(&p, vec![0x5Au8; 300_000]).unwrap();
    assert!(matches!(
        RingReader::open(&p),
        Err(ShmError::BadMagic { .. })
    ));
    let before_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let w = RingWriter::open(
        &p,
        &WriterOptions {
            seq_base: None,
            ..opts(1)
        },
    )
    .unwrap();
    assert!(!w.adopted());
    assert!(w.next_seq() >= before_us, "unknown H: starts at Unix µs");
    drop(w);
    // Known H (different capacity forces re-creation): starts at H + 2.
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(w.adopted());
    for _ in 0..5 {
        write(&mut w, 10);
    }
    let h = w.newest();
    let id = w.ring_id();
    drop(w);
    let big = WriterOptions {
        capacity: 128 * 1024,
        seq_base: None,
        group_read: false,
    };
    let w = RingWriter::open(&p, &big).unwrap();
    assert!(!w.adopted());
    assert_ne!(w.ring_id(), id);
    assert_eq!(w.next_seq(), h + 2);
    assert_eq!((w.oldest(), w.newest()), (h + 2, h + 1));
    drop(w);
    // explicit seq_base overrides
    let w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(!w.adopted());
    assert_eq!(w.next_seq(), 1);
}

#[test]
fn recreate_on_corrupt_cursors() {
    let d = tmpdir();
    let p = ring_path(&d);
    {
        let mut w = RingWriter::open(&p, &opts(1)).unwrap();
        for _ in 0..20 {
            write(&mut w, 100);
        }
    }
    // Scribble over the first record header.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    let data_off = 4096 + ((index_slots(65536) * 8 + 4095) & !4095);
    f.write_all_at(&[0xEE; 16], data_off).unwrap();
    let w = RingWriter::open(
        &p,
        &WriterOptions {
            seq_base: None,
            ..opts(1)
        },
    )
    .unwrap();
    assert!(!w.adopted());
    assert_eq!(w.next_seq(), 22, "H = 20 known from the header: H + 2");
}

#[test]
fn file_mode_and_errors() {
    let d = tmpdir();
    let p = ring_path(&d);
    let w = RingWriter::open(&p, &opts(1)).unwrap();
    let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(matches!(
        RingWriter::open(&p, &opts(1)),
        Err(ShmError::Locked { pid, .. }) if pid == std::process::id()
    ));
    drop(w);
    let p2 = d.path().join("group.ring");
    let _w2 = RingWriter::open(
        &p2,
        &WriterOptions {
            group_read: true,
            ..opts(1)
        },
    )
    .unwrap();
    assert_eq!(
        std::fs::metadata(&p2).unwrap().permissions().mode() & 0o777,
        0o640
    );
    assert!(matches!(
        RingReader::open(&d.path().join("missing.ring")),
        Err(ShmError::NotFound { .. })
    ));
    let small = d.path().join("small.ring");
    std::fs::write(&small, [0u8; 100]).unwrap();
    assert!(matches!(
        RingReader::open(&small),
        Err(ShmError::TooSmall { .. })
    ));
    // Wrong version.
    let v = d.path().join("version.ring");
    std::fs::copy(&p, &v).unwrap();
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(&v).unwrap();
    f.write_all_at(&99u32.to_le_bytes(), OFF_VERSION as u64)
        .unwrap();
    assert!(matches!(
        RingReader::open(&v),
        Err(ShmError::BadVersion { found: 99, .. })
    ));
    // Permission denied (only meaningful when not root).
    // SAFETY: geteuid takes no arguments, cannot fail and touches no memory.
    let is_root = unsafe { libc_geteuid() } == 0;
    if !is_root {
        std::fs::set_permissions(&v, std::fs::Permissions::from_mode(0o000)).unwrap();
        assert!(matches!(
            RingReader::open(&v),
            Err(ShmError::PermissionDenied { .. })
        ));
    }
    // /dev/shm full: an impossible size fails at create, not with SIGBUS.
    if d.path().starts_with("/dev/shm") {
        let huge = WriterOptions {
            capacity: 1 << 40,
            seq_base: Some(1),
            group_read: false,
        };
        match RingWriter::open(&d.path().join("huge.ring"), &huge) {
            Err(ShmError::NoSpace { requested, .. }) => assert!(requested > 1 << 40),
            o => panic!("{o:?}"),
        }
        assert!(!d.path().join("huge.ring").exists());
    }
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

#[test]
fn writer_gone_and_ring_reset() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    write(&mut w, 10);
    let mut r = RingReader::open(&p).unwrap();
    assert!(r.writer_alive());
    drop(w);
    assert!(!r.writer_alive());
    assert_eq!(
        read_ok(&mut r),
        1,
        "records stay readable after the writer left"
    );
    assert!(matches!(r.next(), ReadOutcome::WriterGone));
    let t = Instant::now();
    assert!(matches!(
        r.next_blocking(Duration::from_millis(50)),
        ReadOutcome::WriterGone
    ));
    assert!(t.elapsed() >= Duration::from_millis(45));
    // Restart: adopted, same ring: reader just continues.
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(w.adopted());
    assert!(matches!(r.next(), ReadOutcome::Empty));
    write(&mut w, 10);
    assert_eq!(read_ok(&mut r), 2);
    drop(w);
    // Re-created (capacity change): reader is told, switches, starts at O.
    let mut w = RingWriter::open(
        &p,
        &WriterOptions {
            capacity: 128 * 1024,
            seq_base: None,
            group_read: false,
        },
    )
    .unwrap();
    assert!(!w.adopted());
    write(&mut w, 10);
    let id = w.ring_id();
    match r.next() {
        ReadOutcome::RingReset { new_ring_id } => assert_eq!(new_ring_id, id),
        o => panic!("{o:?}"),
    }
    assert_eq!(r.ring_id(), id);
    assert_eq!(read_ok(&mut r), 4); // H = 2 -> new ring starts at 4
}

#[test]
fn futex_wait_on_read_only_mapping_is_woken() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    let h = std::thread::spawn(move || {
        let t = Instant::now();
        let seq = match r.next_blocking(Duration::from_secs(10)) {
            ReadOutcome::Record(v) => v.seq(),
            o => panic!("{o:?}"),
        };
        (seq, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    write(&mut w, 10);
    let (seq, waited) = h.join().unwrap();
    assert_eq!(seq, 1);
    assert!(
        waited < Duration::from_secs(2),
        "woken by FUTEX_WAKE, not timeout: {waited:?}"
    );
    // And an Empty after a timeout when nothing comes.
    let mut r = RingReader::open(&p).unwrap();
    r.seek(2).unwrap();
    assert!(matches!(
        r.next_blocking(Duration::from_millis(30)),
        ReadOutcome::Empty
    ));
}

#[test]
fn reader_without_spin_sleeps_and_is_woken_by_the_commit() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    let mut r = RingReader::open(&p).unwrap();
    r.set_spin(Duration::ZERO);
    let h = std::thread::spawn(move || match r.next_blocking(Duration::from_secs(30)) {
        ReadOutcome::Record(v) => v.seq(),
        o => panic!("{o:?}"),
    });
    // The reader counts itself as a sleeper in `<ring>.wake` right before its FUTEX_WAIT:
    // with no spin it gets there without any record being published.
    let wake = wake_path(&p);
    let off = WAKE_OFF_WAITERS;
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read(&wake).unwrap()[off..off + 4] == [0; 4] {
        assert!(Instant::now() < deadline, "the reader never went to sleep");
        std::thread::sleep(Duration::from_millis(1));
    }
    write(&mut w, 10);
    assert_eq!(h.join().unwrap(), 1);
    assert_eq!(std::fs::read(&wake).unwrap()[off..off + 4], [0; 4]);
}

#[test]
fn clones_share_mapping_with_own_positions() {
    let d = tmpdir();
    let p = ring_path(&d);
    let mut w = RingWriter::open(&p, &opts(1)).unwrap();
    for _ in 0..3 {
        write(&mut w, 10);
    }
    let mut a = RingReader::open(&p).unwrap();
    read_ok(&mut a);
    let mut b = a.clone();
    assert_eq!(read_ok(&mut a), 2);
    assert_eq!(read_ok(&mut b), 2);
    fn assert_send<T: Send>() {}
    assert_send::<RingReader>();
    assert_send::<RingWriter>();
}

/// Writer notes (LAYOUT.md §3.1): a new ring has none; an adopting writer gets what the last
/// `set_notes` left; what sits in the inactive area (a `set_notes` killed half-way) never shows;
/// a recreated ring starts empty again; more than the header holds is refused.
#[test]
fn writer_notes_survive_adoption_and_a_torn_update() {
    let d = tmpdir();
    let p = ring_path(&d);
    let note = |b: u8| [b; NOTE_LEN];
    {
        let mut w = RingWriter::open(&p, &opts(1)).unwrap();
        assert!(w.notes().is_empty());
        w.set_notes(&[note(1), note(2)]).unwrap();
        w.set_notes(&[note(3), note(4), note(5)]).unwrap();
        assert_eq!(w.notes(), vec![note(3), note(4), note(5)]);
        write(&mut w, 100);
        let too_many = vec![note(9); NOTES_MAX + 1];
        assert!(w.set_notes(&too_many).is_err());
        assert_eq!(w.notes().len(), 3);
    }
    // A successor killed while writing the inactive area: garbage there, control unchanged.
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        let ctl = {
            let w = RingWriter::open(
                &p,
                &WriterOptions {
                    seq_base: None,
                    ..opts(1)
                },
            )
            .unwrap();
            assert_eq!(w.notes(), vec![note(3), note(4), note(5)]);
            drop(w);
            std::fs::read(&p).unwrap()[OFF_NOTES_CTL..OFF_NOTES_CTL + 8].to_vec()
        };
        let active_b = u64::from_le_bytes(ctl.try_into().unwrap()) >> 32 & 1 == 1;
        let inactive = if active_b { OFF_NOTES_A } else { OFF_NOTES_B };
        f.seek(SeekFrom::Start(inactive as u64)).unwrap();
        f.write_all(&[0xAB; NOTES_MAX * NOTE_LEN]).unwrap();
    }
    let mut w = RingWriter::open(
        &p,
        &WriterOptions {
            seq_base: None,
            ..opts(1)
        },
    )
    .unwrap();
    assert!(w.adopted());
    assert_eq!(w.notes(), vec![note(3), note(4), note(5)]);
    w.set_notes(&[note(6)]).unwrap();
    drop(w);
    let w = RingWriter::open(
        &p,
        &WriterOptions {
            seq_base: None,
            ..opts(1)
        },
    )
    .unwrap();
    assert_eq!(w.notes(), vec![note(6)]);
    drop(w);
    // A new ring at the path: nothing of the old one's notes.
    remove_ring(&p).unwrap();
    let w = RingWriter::open(&p, &opts(1)).unwrap();
    assert!(!w.adopted());
    assert!(w.notes().is_empty());
}
