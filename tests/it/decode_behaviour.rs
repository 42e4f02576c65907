//! Targeted behaviour: SMG filter reasons, group kinds pinned and remembered, splitting, malformed input,
//! limits, counters.
use kvbridge::decode::{
    DecodeConfig, DecodeErrorKind, Decoder, Profile, RecordHeader, MAX_SKIP_DEPTH,
};
use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch};
use prost::Message;
use rmp::encode as e;

/// Tiny msgpack builder.
#[derive(Default)]
struct B(Vec<u8>);
impl B {
    fn arr(&mut self, n: u32) -> &mut Self {
        e::write_array_len(&mut self.0, n).unwrap();
        self
    }
    fn map(&mut self, n: u32) -> &mut Self {
        e::write_map_len(&mut self.0, n).unwrap();
        self
    }
    fn s(&mut self, s: &str) -> &mut Self {
        e::write_str(&mut self.0, s).unwrap();
        self
    }
    fn u(&mut self, v: u64) -> &mut Self {
        e::write_uint(&mut self.0, v).unwrap();
        self
    }
    fn nil(&mut self) -> &mut Self {
        e::write_nil(&mut self.0).unwrap();
        self
    }
    fn f(&mut self, v: f64) -> &mut Self {
        e::write_f64(&mut self.0, v).unwrap();
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// A map-form store: hashes 1..=n (+base), bs 16, tokens, optional extra fields.
    fn store(
        &mut self,
        base: u64,
        n: u64,
        extra: &[(&str, &str)],
        group: Option<u64>,
    ) -> &mut Self {
        self.map(5 + extra.len() as u32 + group.is_some() as u32);
        self.s("type").s("BlockStored");
        self.s("block_hashes").arr(n as u32);
        for i in 0..n {
            self.u(base + i);
        }
        self.s("parent_block_hash").nil();
        self.s("token_ids").arr(16 * n as u32);
        for i in 0..16 * n {
            self.u(100_000 + i);
        }
        self.s("block_size").u(16);
        for (k, v) in extra {
            self.s(k).s(v);
        }
        if let Some(g) = group {
            self.s("group_idx").u(g);
        }
        self
    }
    fn removal(&mut self, hashes: &[u64], extra: &[(&str, &str)], group: Option<u64>) -> &mut Self {
        self.map(2 + extra.len() as u32 + group.is_some() as u32);
        self.s("type").s("BlockRemoved");
        self.s("block_hashes").arr(hashes.len() as u32);
        for &h in hashes {
            self.u(h);
        }
        for (k, v) in extra {
            self.s(k).s(v);
        }
        if let Some(g) = group {
            self.s("group_idx").u(g);
        }
        self
    }
    fn batch(&mut self, nev: u32) -> &mut Self {
        self.arr(2).f(1.5).arr(nev)
    }
}

fn records(dec: &mut Decoder, p: &[u8]) -> Vec<KvEventBatch> {
    let plan = dec.plan(p).unwrap();
    let mut eid = 1;
    (0..plan.records)
        .map(|i| {
            let hdr = RecordHeader {
                sequence_number: 1 + i as u64,
                first_event_id: eid,
                dp_rank: None,
            };
            let mut buf = vec![0; dec.record_len(i, &hdr)];
            dec.write_record(p, i, &hdr, &mut buf);
            eid += dec.record_events(i);
            let m = KvEventBatch::decode(&buf[..]).unwrap();
            assert_eq!(m.encode_to_vec(), buf);
            assert!(buf.len() <= dec.config().split_threshold);
            m
        })
        .collect()
}

fn smg() -> Decoder {
    Decoder::new(DecodeConfig::default())
}

#[test]
fn smg_filter_reasons() {
    let mut b = B::default();
    b.batch(9);
    b.store(1, 1, &[("medium", "DISK")], None); // tier
    b.store(2, 1, &[("medium", "obj")], None); // tier
    b.store(3, 1, &[("kv_cache_spec_kind", "sliding_window")], Some(1)); // group (and remembers 1)
    b.store(4, 1, &[], Some(1)); // group, by memory
    b.removal(&[4], &[], Some(1)); // group, by memory
    b.store(5, 1, &[("locality", "REMOTE")], None); // remote
    b.removal(&[6], &[("ownership", "KvCr")], None); // ownership
    b.map(2)
        .s("type")
        .s("AllBlocksCleared")
        .s("ownership")
        .s("kvcr"); // ownership
    b.store(
        7,
        1,
        &[("medium", "GPU"), ("kv_cache_spec_kind", "mla_attention")],
        Some(0),
    ); // kept
    let mut d = smg();
    let recs = records(&mut d, &b.0);
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].events.len(), 1);
    assert_eq!(recs[0].events[0].event_id, 1);
    let st = d.stats();
    assert_eq!(st.filtered_tier, 2);
    assert_eq!(st.filtered_group, 3);
    assert_eq!(st.filtered_remote, 1);
    assert_eq!(st.filtered_ownership, 2);
    assert_eq!(
        (st.stored_events, st.removed_events, st.cleared_events),
        (6, 2, 1)
    );
    // group memory persists across batches
    let mut b2 = B::default();
    b2.batch(1).removal(&[9], &[], Some(1));
    assert_eq!(d.plan(&b2.0).unwrap().records, 0);
    assert_eq!(d.stats().emptied_batches, 1);
    // a store that declares another kind under a pinned group is another cache under the same
    // index (DeepSeek-V4's indexer cache): dropped as a conflict, and nothing is learnt from it
    let mut b3 = B::default();
    b3.batch(2)
        .store(10, 1, &[("kv_cache_spec_kind", "full_attention")], Some(1))
        .removal(&[9], &[], Some(1));
    assert_eq!(d.plan(&b3.0).unwrap().records, 0);
    assert_eq!(d.stats().filtered_group_conflict, 1);
    assert_eq!(d.stats().filtered_group, 5);
    // a removal of a group no store was seen of: its kind is unknown, it is dropped
    let mut b4 = B::default();
    b4.batch(1).removal(&[11], &[], Some(5));
    assert_eq!(d.plan(&b4.0).unwrap().records, 0);
    assert_eq!(d.stats().filtered_group_unknown, 1);
    // a new engine incarnation teaches its groups again
    d.forget_groups();
    assert_eq!(records(&mut d, &b3.0)[0].events.len(), 2);
    // Profile::All keeps everything
    let mut all = Decoder::new(DecodeConfig {
        profile: Profile::All,
        ..Default::default()
    });
    assert_eq!(records(&mut all, &b.0)[0].events.len(), 9);
}

#[test]
fn unpairable_and_empty_batches() {
    // compacted hashes: 2 hashes, 48 tokens, bs 16
    let mut b = B::default();
    b.batch(1)
        .map(5)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(2)
        .u(1)
        .u(2);
    b.s("parent_block_hash").u(77).s("token_ids").arr(48);
    for i in 0..48 {
        b.u(i);
    }
    b.s("block_size").u(16);
    let mut d = smg();
    assert_eq!(d.plan(&b.0).unwrap().records, 0);
    assert_eq!(
        (d.stats().unpairable_stores, d.stats().filtered_unpairable),
        (1, 1)
    );
    let mut all = Decoder::new(DecodeConfig {
        profile: Profile::All,
        ..Default::default()
    });
    let r = records(&mut all, &b.0);
    let Some(Data::Stored(s)) = &r[0].events[0].data else {
        panic!()
    };
    assert_eq!(s.parent_block_hash, Some(77));
    assert!(s
        .blocks
        .iter()
        .all(|b| b.token_ids.is_empty() && b.block_size == 0));
    assert_eq!(all.stats().hash_only_stores, 1);
    // zero events
    let mut e0 = B::default();
    e0.batch(0);
    assert_eq!(d.plan(&e0.0).unwrap().records, 0);
    assert_eq!(d.stats().empty_batches, 1);
}

#[test]
fn split_big_store_into_one_chain() {
    let mut b = B::default();
    b.batch(3)
        .store(1000, 200, &[("medium", "GPU"), ("lora_name", "x")], None);
    b.removal(&(0..3000).collect::<Vec<_>>(), &[], None);
    b.arr(1).s("AllBlocksCleared");
    let thr = 4096;
    let mut d = Decoder::new(DecodeConfig {
        split_threshold: thr,
        ..Default::default()
    });
    let recs = records(&mut d, &b.0);
    assert!(recs.len() >= 4, "{}", recs.len());
    assert_eq!(d.stats().split_events, 2);
    assert_eq!(d.stats().split_batches, 1);
    let evs: Vec<_> = recs.iter().flat_map(|r| r.events.clone()).collect();
    let ids: Vec<u64> = evs.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (1..=evs.len() as u64).collect::<Vec<_>>());
    let mut parent = None;
    let mut blocks = 0;
    let mut hashes = vec![];
    for e in &evs {
        match e.data.as_ref().unwrap() {
            Data::Stored(s) => {
                assert_eq!(s.parent_block_hash, parent);
                assert_eq!(s.lora_name.as_deref(), Some("x"));
                for (i, blk) in s.blocks.iter().enumerate() {
                    assert_eq!(blk.block_hash, 1000 + blocks + i as i64);
                    assert_eq!(blk.token_ids.len(), 16);
                    assert_eq!(blk.token_ids[0], 100_000 + 16 * (blocks as u32 + i as u32));
                }
                blocks += s.blocks.len() as i64;
                parent = Some(s.blocks.last().unwrap().block_hash);
            }
            Data::Removed(r) => hashes.extend(r.block_hashes.clone()),
            Data::Cleared(_) => assert_eq!(hashes.len(), 3000),
        }
    }
    assert_eq!(blocks, 200);
    assert_eq!(hashes, (0..3000).collect::<Vec<i64>>());
    assert!(recs.iter().all(|r| r.timestamp == 1.5));
}

#[test]
fn oversized_single_block_is_dropped() {
    // one block of 4000 tokens (≈ 12 KB) cannot fit a 4 KiB record
    let mut b = B::default();
    b.batch(2)
        .map(5)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .u(5);
    b.s("parent_block_hash").nil().s("token_ids").arr(4000);
    for _ in 0..4000 {
        b.u(150_000);
    }
    b.s("block_size").u(4000);
    b.removal(&[5], &[], None);
    let mut d = Decoder::new(DecodeConfig {
        split_threshold: 4096,
        ..Default::default()
    });
    let r = records(&mut d, &b.0);
    assert_eq!(r.len(), 1);
    assert_eq!(d.stats().oversized_events, 1);
}

#[test]
fn malformed_events_are_skipped_and_counted() {
    let mut b = B::default();
    b.batch(9);
    b.map(1).s("type").s("BlockStored"); // no hashes
    b.arr(3).s("BlockRemoved").s("not-an-array").nil(); // wrong type → lost removal
    b.map(2)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .arr(1)
        .f(1.0); // float hash
    b.map(2)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .arr(1)
        .raw(&[0xc4, 0x00]); // empty bin
    b.u(5); // not an event
    b.arr(2).s("BlockPinned").arr(0); // unknown tag (BlockInactive is counted apart)
    b.map(2)
        .s("type")
        .s("BlockStored")
        .s("medium")
        .raw(&[0xa2, 0xff, 0xfe]); // bad utf-8
    b.arr(0); // empty array
    b.removal(&[1, 2], &[("future", "x")], None); // fine (+1 unknown key)
    let mut d = smg();
    let plan = d.plan(&b.0).unwrap();
    assert_eq!(plan.records, 1);
    assert_eq!(plan.lost_removals, 3);
    let st = d.stats().clone();
    assert_eq!(st.malformed_events, 7, "{st:?}");
    assert_eq!(st.malformed_removals, 3);
    assert_eq!(st.invalid_utf8, 1);
    assert_eq!(st.unknown_tags, 1);
    assert_eq!(st.unknown_keys, 1);
    assert_eq!(records(&mut d, &b.0)[0].events.len(), 1);
}

#[test]
fn locality_and_extra_key_shapes() {
    let mut b = B::default();
    b.batch(1)
        .map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(2)
        .u(1)
        .u(2);
    b.s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(2)
        .u(1)
        .u(2)
        .s("block_size")
        .u(1);
    b.s("locality").s("ELSEWHERE");
    // entry 0: [1.5 (skipped), {"a":1} (skipped), "ok"]; entry 1: "solo" (scalar entry)
    b.s("extra_keys")
        .arr(2)
        .arr(3)
        .f(1.5)
        .map(1)
        .s("a")
        .u(1)
        .s("ok")
        .s("solo");
    b.s("lora_id").raw(&[0xc4, 0x02, 0x01, 0x00]); // bin lora_id → 256
    let mut d = Decoder::new(DecodeConfig {
        profile: Profile::All,
        ..Default::default()
    });
    let r = records(&mut d, &b.0);
    let Some(Data::Stored(s)) = &r[0].events[0].data else {
        panic!()
    };
    assert_eq!(s.locality, None);
    assert_eq!(s.blocks[0].extra_keys.len(), 1);
    assert_eq!(s.blocks[1].extra_keys.len(), 1);
    assert_eq!(s.blocks[0].lora_id, Some(256));
    assert_eq!(d.stats().locality_unknown, 1);
    assert_eq!(d.stats().extra_key_shapes_skipped, 2);
}

#[test]
fn batch_level_errors_are_typed_with_offsets() {
    type Case = (Vec<u8>, fn(&DecodeErrorKind) -> bool, usize);
    let cases: Vec<Case> = vec![
        (vec![], |k| matches!(k, DecodeErrorKind::Empty), 0),
        (
            vec![0x92, 0xcb, 0x41],
            |k| matches!(k, DecodeErrorKind::Truncated { .. }),
            2,
        ),
        (
            vec![0x93, 0xcb, 0x41],
            |k| matches!(k, DecodeErrorKind::LengthExceedsInput { declared: 3 }),
            0,
        ),
        (
            vec![0x91, 0x00],
            |k| matches!(k, DecodeErrorKind::BatchTooShort { len: 1 }),
            0,
        ),
        (
            vec![0xa1, 0x41],
            |k| matches!(k, DecodeErrorKind::WrongType { .. }),
            0,
        ),
        // 4-billion-element array header in a tiny frame
        (
            vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x00],
            |k| matches!(k, DecodeErrorKind::LengthExceedsInput { .. }),
            2,
        ),
        (
            vec![0x92, 0xc3, 0x90],
            |k| matches!(k, DecodeErrorKind::WrongType { what: "ts", .. }),
            1,
        ),
        (
            vec![0x92, 0x00, 0x91, 0xc1],
            |k| matches!(k, DecodeErrorKind::InvalidMarker),
            3,
        ),
        (
            vec![0x81, 0xa2, b't', b's', 0x00],
            |k| matches!(k, DecodeErrorKind::MissingField("events")),
            0,
        ),
    ];
    for (p, ok, off) in cases {
        let mut d = smg();
        let err = d.plan(&p).unwrap_err();
        assert!(ok(&err.kind), "{p:02x?}: {err}");
        assert_eq!(err.offset, off, "{p:02x?}: {err}");
        assert!(err.to_string().ends_with(&format!(" at byte {off}")));
    }
}

#[test]
fn deep_nesting_and_limits() {
    // an unknown key holding 100 nested arrays
    let mut b = B::default();
    b.batch(1).map(2).s("type").s("AllBlocksCleared").s("deep");
    for _ in 0..100 {
        b.arr(1);
    }
    b.u(1);
    let mut d = smg();
    let err = d.plan(&b.0).unwrap_err();
    assert_eq!(
        err.kind,
        DecodeErrorKind::TooDeep {
            limit: MAX_SKIP_DEPTH
        }
    );
    assert_eq!(d.stats().err_depth, 1);
    // nesting within the bound is skipped fine
    let mut ok = B::default();
    ok.batch(1).map(2).s("type").s("AllBlocksCleared").s("deep");
    for _ in 0..MAX_SKIP_DEPTH - 1 {
        ok.arr(1);
    }
    ok.u(1);
    assert_eq!(d.plan(&ok.0).unwrap().records, 1);
    // events per batch / blocks per event
    let mut d = Decoder::new(DecodeConfig {
        max_events: 2,
        max_blocks_per_event: 3,
        ..Default::default()
    });
    let mut b = B::default();
    b.batch(3)
        .removal(&[1], &[], None)
        .removal(&[1], &[], None)
        .removal(&[1], &[], None);
    assert!(matches!(
        d.plan(&b.0).unwrap_err().kind,
        DecodeErrorKind::TooManyEvents { count: 3, limit: 2 }
    ));
    let mut b = B::default();
    b.batch(2)
        .removal(&[1, 2, 3, 4], &[], None)
        .store(1, 4, &[], None);
    let plan = d.plan(&b.0).unwrap();
    assert_eq!((plan.records, plan.lost_removals), (0, 1));
    assert_eq!(d.stats().too_many_blocks, 2);
    let mut d = Decoder::new(DecodeConfig {
        max_payload: 10,
        ..Default::default()
    });
    assert!(matches!(
        d.plan(&[0x90; 11]).unwrap_err().kind,
        DecodeErrorKind::PayloadTooLarge { .. }
    ));
}

#[test]
fn map_batch_fallback_and_trailing() {
    let mut b = B::default();
    b.map(4)
        .s("data_parallel_rank")
        .u(2)
        .s("events")
        .arr(1)
        .arr(1)
        .s("AllBlocksCleared");
    b.s("zz").u(1).s("ts").u(1700000000);
    let mut d = smg();
    let plan = d.plan(&b.0).unwrap();
    assert_eq!(
        (plan.records, plan.rank, plan.ts),
        (1, Some(2), 1700000000.0)
    );
    assert_eq!((d.stats().map_batches, d.stats().unknown_keys), (1, 1));
    // float32 ts, extra trailing element, trailing bytes
    let mut b = B::default();
    b.arr(4);
    e::write_f32(&mut b.0, 2.5).unwrap();
    b.arr(0).nil().s("extra").u(9);
    let plan = d.plan(&b.0).unwrap();
    assert_eq!((plan.records, plan.rank, plan.ts), (0, None, 2.5));
    assert_eq!(d.stats().trailing_bytes, 1);
}

#[test]
fn token_values_are_validated_on_both_walks() {
    // n blocks of bs tokens with one bad token value (negative / > u32::MAX)
    fn store(n: u32, bs: u32, bad: &[u8]) -> Vec<u8> {
        let mut b = B::default();
        b.batch(1).arr(5).s("BlockStored").arr(n);
        for i in 0..n {
            b.u(i as u64 + 1);
        }
        b.nil().arr(n * bs);
        for i in 0..n * bs - 1 {
            b.u(i as u64);
        }
        b.raw(bad).u(bs as u64);
        b.0
    }
    for bad in [&[0xff][..], &[0xd0, 0x80], &[0xcf, 1, 0, 0, 0, 0, 0, 0, 0]] {
        // 2 × 16 tokens: measured while reading (hint 16)
        let mut d = smg();
        assert_eq!(d.plan(&store(2, 16, bad)).unwrap().records, 0);
        assert_eq!(
            (d.stats().malformed_events, d.stats().stored_events),
            (1, 0)
        );
        // 3 × 5 tokens: not a multiple of the hint, caught by the measuring walk
        let mut d = smg();
        assert_eq!(d.plan(&store(3, 5, bad)).unwrap().records, 0);
        assert_eq!(
            (d.stats().malformed_events, d.stats().stored_events),
            (1, 0)
        );
        // a good store afterwards still decodes (scratch rolled back)
        let good = store(3, 5, &[0x05]);
        assert_eq!(records(&mut d, &good)[0].events.len(), 1);
    }
    // non-negative signed markers are accepted as token ids
    let mut d = smg();
    let r = records(&mut d, &store(1, 2, &[0xd3, 0, 0, 0, 0, 0, 0, 0, 9]));
    let Some(Data::Stored(s)) = &r[0].events[0].data else {
        panic!()
    };
    assert_eq!(s.blocks[0].token_ids, vec![0, 9]);
}
