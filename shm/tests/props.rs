//! Property tests: random record lengths, a reader that polls at random
//! intervals, and a restart (adoption) at the end.
#![cfg(not(loom))]
mod common;
use common::*;
use kvbridge_shm::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_lengths_reads_exact_or_lapped(
        ops in proptest::collection::vec((0usize..=layout::max_payload(64 * 1024), 0u8..4), 1..300)
    ) {
        let d = tmpdir();
        let p = ring_path(&d);
        let mut w = RingWriter::open(&p, &opts(1)).unwrap();
        let mut r = RingReader::open(&p).unwrap();
        let mut expected = 1u64;
        for (len, reads) in ops {
            write(&mut w, len);
            for _ in 0..reads {
                match r.next() {
                    ReadOutcome::Record(v) => {
                        prop_assert_eq!(v.seq(), expected);
                        prop_assert_eq!(v.meta(), meta(v.seq()));
                        let mut got = Vec::new();
                        prop_assert!(v.copy_to(&mut got));
                        prop_assert_eq!(&got, &payload(v.seq(), got.len()));
                        expected += 1;
                    }
                    ReadOutcome::Lapped { missed, resume_at } => {
                        prop_assert_eq!(resume_at, expected + missed);
                        prop_assert_eq!(resume_at, w.oldest());
                        expected = resume_at;
                    }
                    ReadOutcome::Empty => prop_assert_eq!(expected, w.next_seq()),
                    o => prop_assert!(false, "{:?}", o),
                }
            }
            prop_assert!(w.oldest() <= w.newest() + 1);
            prop_assert_eq!(r.newest(), w.newest());
            prop_assert_eq!(r.oldest(), w.oldest());
        }
        // Restart: adopt, same window, continue at N + 1.
        let (o, n, id) = (w.oldest(), w.newest(), w.ring_id());
        drop(w);
        let mut w = RingWriter::open(&p, &opts(1)).unwrap();
        prop_assert!(w.adopted());
        prop_assert_eq!((w.oldest(), w.newest(), w.ring_id()), (o, n, id));
        let mut r2 = RingReader::open(&p).unwrap();
        for s in o..=n {
            prop_assert_eq!(read_ok(&mut r2), s);
        }
        prop_assert_eq!(write(&mut w, 10), n + 1);
        prop_assert_eq!(read_ok(&mut r2), n + 1);
    }
}
