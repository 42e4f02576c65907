//! Property test: random batches written by an independent msgpack encoder
//! ([`common::prop_batch`]), decoded with random split thresholds, reassemble to the input.

use crate::common;

use common::prop_batch::encoder::{encode, expected_ts};
use common::prop_batch::*;
use kvbridge::decode::Decoder;
use kvbridge::proto::common::{kv_cache_event::Data, KvBlock, KvBlocksRemoved, KvBlocksStored};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_splits_reassemble(b in arb_batch(), thr in 4096usize..20000) {
        let (payload, _model, _) = encode(&b);
        let whole = decode_all(&mut Decoder::new(cfg(1 << 30)), &payload, 1 << 30);
        let whole: Vec<Data> = whole.into_iter().flat_map(|r| r.events).map(|e| e.data.unwrap()).collect();
        let mut dec = Decoder::new(cfg(thr));
        let parts = decode_all(&mut dec, &payload, thr);
        for r in &parts {
            prop_assert_eq!(r.timestamp, expected_ts(&b));
        }
        let mut it = parts.into_iter().flat_map(|r| r.events).map(|e| e.data.unwrap()).peekable();
        for w in whole {
            match w {
                Data::Stored(ws) => {
                    let mut got: Vec<KvBlock> = Vec::new();
                    let mut parent = ws.parent_block_hash;
                    while got.len() < ws.blocks.len() {
                        let Some(Data::Stored(p)) = it.next() else { panic!("missing store part") };
                        prop_assert!(!p.blocks.is_empty());
                        prop_assert_eq!(p.parent_block_hash, parent);
                        let same = KvBlocksStored { blocks: vec![], parent_block_hash: None, ..p.clone() };
                        let wsame = KvBlocksStored { blocks: vec![], parent_block_hash: None, ..ws.clone() };
                        prop_assert_eq!(same, wsame);
                        parent = Some(p.blocks.last().unwrap().block_hash);
                        got.extend(p.blocks);
                    }
                    prop_assert_eq!(got, ws.blocks);
                }
                Data::Removed(wr) => {
                    let mut got = Vec::new();
                    while got.len() < wr.block_hashes.len() {
                        let Some(Data::Removed(p)) = it.next() else { panic!("missing removal part") };
                        prop_assert!(!p.block_hashes.is_empty());
                        let same = KvBlocksRemoved { block_hashes: vec![], ..p.clone() };
                        prop_assert_eq!(same, KvBlocksRemoved { block_hashes: vec![], ..wr.clone() });
                        got.extend(p.block_hashes);
                    }
                    prop_assert_eq!(got, wr.block_hashes);
                }
                c => prop_assert_eq!(it.next(), Some(c)),
            }
        }
        prop_assert!(it.next().is_none());
    }
}
