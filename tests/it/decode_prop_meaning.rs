//! Property test: random batches written by an independent msgpack encoder
//! ([`common::prop_batch`]) decode to the same meaning.

use crate::common;

use common::prop_batch::encoder::{encode, expected_ts};
use common::prop_batch::*;
use kvbridge::decode::Decoder;
use kvbridge::proto::common::{
    kv_block_extra_key::Key, kv_cache_event::Data, KvBlock, KvBlockExtraKey, KvBlocksRemoved,
    KvBlocksStored, KvCacheCleared, KvMultimodalKey,
};
use proptest::prelude::*;

// ---------------------------------------------------------------- expected meaning

fn tier(m: &Option<String>) -> Option<i32> {
    match m.as_deref()?.to_ascii_uppercase().as_str() {
        "GPU" => Some(1),
        "CPU" | "CPU_PINNED" => Some(2),
        "DISK" | "FS" | "STORAGE" => Some(3),
        "OBJ" | "EXTERNAL" => Some(4),
        _ => None,
    }
}

fn loc(l: &Option<String>) -> Option<i32> {
    match l.as_deref()? {
        "LOCAL" => Some(1),
        "REMOTE" => Some(2),
        _ => None,
    }
}

fn leaf_key(l: &Leaf) -> KvBlockExtraKey {
    KvBlockExtraKey {
        key: Some(match l {
            Leaf::Text(s) => Key::Text(s.clone()),
            Leaf::Blob(b) => Key::Blob(b.clone()),
            Leaf::Num(n) => Key::Number(*n),
            Leaf::Mm(s, o) => Key::Multimodal(KvMultimodalKey {
                identifier: s.clone(),
                offset: *o,
            }),
        }),
    }
}

fn entry_keys(items: &[Item]) -> Vec<KvBlockExtraKey> {
    let mut v = Vec::new();
    for it in items {
        match it {
            Item::Leaf(l) => v.push(leaf_key(l)),
            Item::List(ls) => v.extend(ls.iter().map(leaf_key)),
        }
    }
    v
}

fn expect(ev: &Ev) -> Option<Data> {
    Some(match ev {
        Ev::Stored(s) => {
            let bs = s.bs as usize;
            let pair = bs > 0 && s.tokens.len() == s.hashes.len() * bs;
            let t = tier(&s.medium);
            Data::Stored(KvBlocksStored {
                blocks: s
                    .hashes
                    .iter()
                    .enumerate()
                    .map(|(i, h)| KvBlock {
                        block_hash: h.bits(),
                        token_ids: if pair {
                            s.tokens[i * bs..(i + 1) * bs].to_vec()
                        } else {
                            vec![]
                        },
                        block_size: if pair { bs as i32 } else { 0 },
                        lora_id: s.lora_id,
                        cache_level: t.map(|t| t - 1),
                        extra_keys: match &s.extra {
                            Some(x) => x[i].as_deref().map(entry_keys).unwrap_or_default(),
                            None => vec![],
                        },
                    })
                    .collect(),
                parent_block_hash: s.parent.as_ref().map(H::bits),
                tier: t,
                medium: s.medium.clone(),
                group_idx: s.group,
                kv_cache_spec_kind: s.kind.clone(),
                kv_cache_spec_sliding_window: s.sliding,
                locality: loc(&s.locality),
                ownership: s.ownership.clone(),
                session_id: s.session.clone(),
                lora_name: s.lora_name.clone(),
                cache_salt: s.salt.clone(),
            })
        }
        Ev::Removed(r) => {
            let t = tier(&r.medium);
            Data::Removed(KvBlocksRemoved {
                block_hashes: r.hashes.iter().map(H::bits).collect(),
                cache_level: t.map(|t| t - 1),
                tier: t,
                medium: r.medium.clone(),
                group_idx: r.group,
                locality: loc(&r.locality),
                ownership: r.ownership.clone(),
            })
        }
        Ev::Cleared(o) => Data::Cleared(KvCacheCleared {
            ownership: o.clone(),
        }),
        Ev::Unknown => return None,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_batches_decode_to_their_meaning(b in arb_batch()) {
        let (payload, model, en) = encode(&b);
        let mut dec = Decoder::new(cfg(1 << 30));
        let recs = decode_all(&mut dec, &payload, 1 << 30);
        let exp: Vec<Data> = model.iter().filter_map(expect).collect();
        let plan_rank = dec.plan(&payload).unwrap().rank;
        prop_assert_eq!(plan_rank, if b.shape == 0 { None } else { b.rank });
        if exp.is_empty() {
            prop_assert!(recs.is_empty());
        } else {
            prop_assert_eq!(recs.len(), 1);
            prop_assert_eq!(recs[0].timestamp, expected_ts(&b));
            let got: Vec<Data> = recs[0].events.iter().map(|e| e.data.clone().unwrap()).collect();
            prop_assert_eq!(got, exp);
        }
        let st = dec.stats();
        prop_assert_eq!(st.unknown_tags, 2 * en.unknown_tags);
        prop_assert_eq!(st.unknown_keys, 2 * en.unknown_keys);
        prop_assert_eq!(st.malformed_events, 0);
        prop_assert_eq!(st.extra_key_shapes_skipped, 0);
        prop_assert_eq!(st.map_batches, 2 * (b.shape == 3) as u64);
    }
}
