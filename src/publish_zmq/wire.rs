//! A ring record (an SMG `KvEventBatch`) written back as a vLLM `EventBatch`, the payload frame
//! of the engines' own ZMQ wire (docs/engine-wire.md §3–§5).
//!
//! One format for every engine: an SGLang or TokenSpeed worker is written as a vLLM one. Every
//! field the ring carries that the chosen layout has is written; nothing is invented (an absent
//! optional field stays absent, a required one is written as nil). Block hashes (and the parent)
//! are always fixed-width 64-bit msgpack integers, in the engine's own form ([`HashForm`]):
//! unsigned (`cf` + 8 bytes) as vLLM's default int hashes take it, or, for an engine that sends
//! signed int64 (SGLang), `d3` + 8 bytes for a negative one. Either is the canonical int64 key's
//! bits, so every consumer's int64 rule gives back the key kvbridge holds, and no decoder that
//! insists on 64-bit hashes sees a short int.

use crate::proto::common::{
    kv_block_extra_key::Key, kv_cache_event::Data, KvBlock, KvBlocksRemoved, KvBlocksStored,
    KvCacheLocality, KvEventBatch,
};

/// Event encoding of the published batches (`--publish-zmq-layout`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WireLayout {
    /// Tagged maps, as vLLM ≥ 0.24 and SGLang ≥ 0.5.20 send (the newest vLLM field set).
    #[default]
    Map,
    /// Tagged arrays in the vLLM 0.22–0.23 layout (12-element stores, 4-element removals), for
    /// consumers that decode only arrays; fields that layout lacks (locality, ownership,
    /// session) are not written.
    Array,
}

const TAG_STORED: &str = "BlockStored";
const TAG_REMOVED: &str = "BlockRemoved";
const TAG_CLEARED: &str = "AllBlocksCleared";

// Writing into a `Vec` cannot fail: rmp's `Result`s are infallible here.
fn str_(out: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(out, s);
}

fn nil(out: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(out);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(out, v);
}

fn sint(out: &mut Vec<u8>, v: i64) {
    let _ = rmp::encode::write_sint(out, v);
}

fn arr(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(out, n as u32);
}

fn map(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_map_len(out, n as u32);
}

/// The integer form of an engine's block hashes (its batch's ring record says which: the
/// `FLAG_SIGNED_HASHES` record flag).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashForm {
    /// Unsigned 64-bit values, as vLLM sends them: always `cf` + 8 bytes.
    #[default]
    Unsigned,
    /// Signed int64 values, as SGLang sends them: a negative hash is `d3` + 8 bytes (what the
    /// engine's msgspec writes for every value below −2³¹), a non-negative one `cf` + 8 bytes.
    Signed,
}

/// A block hash: fixed width, 8 bytes after the marker (the canonical key's 64 bits), in the
/// engine's integer form.
fn hash(out: &mut Vec<u8>, h: i64, form: HashForm) {
    let _ = match form {
        HashForm::Signed if h < 0 => rmp::encode::write_i64(out, h),
        _ => rmp::encode::write_u64(out, h as u64),
    };
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => str_(out, s),
        None => nil(out),
    }
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(out, v),
        None => nil(out),
    }
}

/// `LOCAL` / `REMOTE`; unspecified is not written.
fn locality(v: Option<i32>) -> Option<&'static str> {
    match v.and_then(|v| KvCacheLocality::try_from(v).ok()) {
        Some(KvCacheLocality::Local) => Some("LOCAL"),
        Some(KvCacheLocality::Remote) => Some("REMOTE"),
        _ => None,
    }
}

/// Writes `batch` as a vLLM `EventBatch` `[ts, events, data_parallel_rank]` into `out`
/// (cleared first). The rank is the record's own `dp_rank` when it has one, else `rank`.
/// Returns the number of events written.
pub fn encode_batch(
    batch: &KvEventBatch,
    rank: i64,
    layout: WireLayout,
    form: HashForm,
    out: &mut Vec<u8>,
) -> usize {
    out.clear();
    arr(out, 3);
    let _ = rmp::encode::write_f64(out, batch.timestamp);
    let events: Vec<&Data> = batch
        .events
        .iter()
        .filter_map(|e| e.data.as_ref())
        .collect();
    let count = events
        .iter()
        .map(|d| match d {
            Data::Stored(s) => wire_events(s),
            _ => 1,
        })
        .sum();
    arr(out, count);
    for d in &events {
        match d {
            Data::Stored(s) if size_runs(s).nth(1).is_none() => stored(s, layout, form, out),
            Data::Stored(s) => {
                // One store per run, each naming the block before it as its parent.
                let mut parent = s.parent_block_hash;
                for run in size_runs(s) {
                    let part = KvBlocksStored {
                        blocks: run.to_vec(),
                        parent_block_hash: parent,
                        ..KvBlocksStored::clone(s)
                    };
                    stored(&part, layout, form, out);
                    parent = run.last().map(|b| b.block_hash);
                }
            }
            Data::Removed(r) => removed(r, layout, form, out),
            Data::Cleared(_) => cleared(layout, out),
        }
    }
    sint(out, batch.dp_rank.map_or(rank, i64::from));
    count
}

/// How many engine-wire events store `s` is written as: one per run of blocks that share a
/// `block_size`.
pub fn wire_events(s: &KvBlocksStored) -> usize {
    size_runs(s).count().max(1)
}

/// The runs of a store's blocks that share one `block_size`. The engine wire has one
/// `block_size` (and one token list) per store, while a snapshot chain can join blocks of
/// different sizes into one `KvBlocksStored` (a hash-only block, size 0, after blocks with
/// tokens: a sliding group's compacted store chained to a full one): written as one store,
/// their tokens could not be paired with their hashes, and every block of it would lose them.
fn size_runs(
    s: &KvBlocksStored,
) -> std::slice::ChunkBy<'_, KvBlock, impl FnMut(&KvBlock, &KvBlock) -> bool> {
    s.blocks.chunk_by(|a, b| a.block_size == b.block_size)
}

/// A batch holding one `AllBlocksCleared`, stamped `ts`, for rank `rank`.
pub fn encode_cleared(ts: f64, rank: i64, layout: WireLayout, out: &mut Vec<u8>) {
    out.clear();
    arr(out, 3);
    let _ = rmp::encode::write_f64(out, ts);
    arr(out, 1);
    cleared(layout, out);
    sint(out, rank);
}

fn cleared(layout: WireLayout, out: &mut Vec<u8>) {
    match layout {
        WireLayout::Map => {
            map(out, 1);
            str_(out, "type");
        }
        WireLayout::Array => arr(out, 1),
    }
    str_(out, TAG_CLEARED);
}

fn hashes(out: &mut Vec<u8>, it: impl ExactSizeIterator<Item = i64>, form: HashForm) {
    arr(out, it.len());
    for h in it {
        hash(out, h, form);
    }
}

/// `extra_keys`: one entry per block, nil for a block without any; `None` when no block has any.
fn has_extra_keys(s: &KvBlocksStored) -> bool {
    s.blocks.iter().any(|b| !b.extra_keys.is_empty())
}

fn extra_keys(s: &KvBlocksStored, out: &mut Vec<u8>) {
    arr(out, s.blocks.len());
    for b in &s.blocks {
        if b.extra_keys.is_empty() {
            nil(out);
            continue;
        }
        arr(out, b.extra_keys.len());
        for k in &b.extra_keys {
            match &k.key {
                Some(Key::Text(t)) => str_(out, t),
                Some(Key::Blob(v)) => {
                    let _ = rmp::encode::write_bin(out, v);
                }
                Some(Key::Number(n)) => sint(out, *n),
                Some(Key::Multimodal(m)) => {
                    arr(out, 2);
                    str_(out, &m.identifier);
                    sint(out, m.offset);
                }
                None => nil(out),
            }
        }
    }
}

fn stored(s: &KvBlocksStored, layout: WireLayout, form: HashForm, out: &mut Vec<u8>) {
    let first = s.blocks.first();
    let block_size = first.map_or(0, |b| b.block_size.max(0) as u64);
    let lora_id = first.and_then(|b| b.lora_id);
    let tokens: usize = s.blocks.iter().map(|b| b.token_ids.len()).sum();
    let ek = has_extra_keys(s);
    let loc = locality(s.locality);
    // The required fields, in declaration order, shared by both layouts.
    let required = |out: &mut Vec<u8>, keyed: bool| {
        let key = |out: &mut Vec<u8>, k: &str| {
            if keyed {
                str_(out, k);
            }
        };
        key(out, "block_hashes");
        hashes(out, s.blocks.iter().map(|b| b.block_hash), form);
        key(out, "parent_block_hash");
        match s.parent_block_hash {
            Some(p) => hash(out, p, form),
            None => nil(out),
        }
        key(out, "token_ids");
        arr(out, tokens);
        for b in &s.blocks {
            for &t in &b.token_ids {
                uint(out, u64::from(t));
            }
        }
        key(out, "block_size");
        uint(out, block_size);
        key(out, "lora_id");
        match lora_id {
            Some(l) => sint(out, l),
            None => nil(out),
        }
        key(out, "medium");
        opt_str(out, s.medium.as_deref());
        key(out, "lora_name");
        opt_str(out, s.lora_name.as_deref());
    };
    match layout {
        WireLayout::Array => {
            arr(out, 12);
            str_(out, TAG_STORED);
            required(out, false);
            if ek {
                extra_keys(s, out);
            } else {
                nil(out);
            }
            opt_uint(out, s.group_idx.map(u64::from));
            opt_str(out, s.kv_cache_spec_kind.as_deref());
            opt_uint(out, s.kv_cache_spec_sliding_window.map(u64::from));
        }
        WireLayout::Map => {
            let optional = [
                ek,
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
                loc.is_some(),
                s.ownership.is_some(),
                s.session_id.is_some(),
            ];
            map(out, 8 + optional.iter().filter(|p| **p).count());
            str_(out, "type");
            str_(out, TAG_STORED);
            required(out, true);
            if ek {
                str_(out, "extra_keys");
                extra_keys(s, out);
            }
            if let Some(g) = s.group_idx {
                str_(out, "group_idx");
                uint(out, u64::from(g));
            }
            if let Some(k) = &s.kv_cache_spec_kind {
                str_(out, "kv_cache_spec_kind");
                str_(out, k);
            }
            if let Some(w) = s.kv_cache_spec_sliding_window {
                str_(out, "kv_cache_spec_sliding_window");
                uint(out, u64::from(w));
            }
            if let Some(l) = loc {
                str_(out, "locality");
                str_(out, l);
            }
            if let Some(o) = &s.ownership {
                str_(out, "ownership");
                str_(out, o);
            }
            if let Some(id) = &s.session_id {
                str_(out, "session_id");
                str_(out, id);
            }
        }
    }
}

fn removed(r: &KvBlocksRemoved, layout: WireLayout, form: HashForm, out: &mut Vec<u8>) {
    match layout {
        WireLayout::Array => {
            arr(out, 4);
            str_(out, TAG_REMOVED);
            hashes(out, r.block_hashes.iter().copied(), form);
            opt_str(out, r.medium.as_deref());
            opt_uint(out, r.group_idx.map(u64::from));
        }
        WireLayout::Map => {
            let loc = locality(r.locality);
            let optional = [r.group_idx.is_some(), loc.is_some(), r.ownership.is_some()];
            map(out, 3 + optional.iter().filter(|p| **p).count());
            str_(out, "type");
            str_(out, TAG_REMOVED);
            str_(out, "block_hashes");
            hashes(out, r.block_hashes.iter().copied(), form);
            str_(out, "medium");
            opt_str(out, r.medium.as_deref());
            if let Some(g) = r.group_idx {
                str_(out, "group_idx");
                uint(out, u64::from(g));
            }
            if let Some(l) = loc {
                str_(out, "locality");
                str_(out, l);
            }
            if let Some(o) = &r.ownership {
                str_(out, "ownership");
                str_(out, o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common::{KvBlock, KvCacheCleared, KvCacheEvent};

    fn batch() -> KvEventBatch {
        let stored = KvBlocksStored {
            blocks: vec![KvBlock {
                block_hash: 0xDEADBEEFCAFEF00Du64 as i64,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                ..Default::default()
            }],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..Default::default()
        };
        let removed = KvBlocksRemoved {
            block_hashes: vec![0xDEADBEEFCAFEF00Du64 as i64],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..Default::default()
        };
        let ev = |d| KvCacheEvent {
            event_id: 1,
            data: Some(d),
        };
        KvEventBatch {
            sequence_number: 1,
            timestamp: 1_700_000_000.5,
            events: vec![
                ev(Data::Stored(stored)),
                ev(Data::Removed(removed)),
                ev(Data::Cleared(KvCacheCleared::default())),
            ],
            dp_rank: None,
            ..Default::default()
        }
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The worked example of docs/engine-wire.md §11.1 (vLLM 0.22–0.23), byte for byte, except
    /// that `extra_keys` is nil here (the ring holds none for this block).
    #[test]
    fn array_layout_is_the_v7_example() {
        let mut out = Vec::new();
        encode_batch(&batch(), 0, WireLayout::Array, HashForm::Unsigned, &mut out);
        let want = "93cb41d954fc40200000939cab426c6f636b53746f72656491cfdeadbeefcafef00dc0940102030404c0a3475055c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfdeadbeefcafef00da34750550091b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&out), want);
    }

    /// §11.2 (vLLM 0.33), with a minimal map header and no `extra_keys` (see above).
    #[test]
    fn map_layout_is_the_v12_example() {
        let mut out = Vec::new();
        encode_batch(&batch(), 0, WireLayout::Map, HashForm::Unsigned, &mut out);
        let want = "93cb41d954fc40200000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdeadbeefcafef00db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdeadbeefcafef00da66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&out), want);
    }

    /// A snapshot chain of two blocks with tokens and a hash-only one after them (a sliding
    /// group's compacted store chained to a full one) is written as one store per block size,
    /// the second naming the first's last block as its parent: read back by a reader that pairs
    /// tokens only where docs/engine-wire.md §9 allows it (kvbridge's decoder), the first two
    /// blocks keep their tokens. As one store (size 4, 8 tokens, 3 hashes) none did.
    #[test]
    fn a_chain_of_blocks_of_different_sizes_is_one_store_per_size() {
        use crate::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
        use prost::Message;
        let blk = |h: i64, tokens: Vec<u32>| KvBlock {
            block_hash: h,
            block_size: tokens.len() as i32,
            token_ids: tokens,
            ..Default::default()
        };
        let chain = vec![
            blk(1, vec![1, 2, 3, 4]),
            blk(2, vec![5, 6, 7, 8]),
            blk(3, vec![]),
        ];
        let mut b = batch();
        b.events.truncate(1);
        if let Some(Data::Stored(s)) = &mut b.events[0].data {
            s.blocks = chain.clone();
            s.parent_block_hash = Some(9);
        }
        for layout in [WireLayout::Map, WireLayout::Array] {
            let mut out = Vec::new();
            assert_eq!(
                encode_batch(&b, 0, layout, HashForm::Unsigned, &mut out),
                2,
                "{layout:?}"
            );
            let mut dec = Decoder::new(DecodeConfig {
                profile: Profile::All,
                ..Default::default()
            });
            let plan = dec.plan(&out).expect("decodable");
            let mut read = Vec::new();
            for i in 0..plan.records {
                let hdr = RecordHeader {
                    sequence_number: 1,
                    first_event_id: 1,
                    dp_rank: None,
                };
                let mut rec = vec![0u8; dec.record_len(i, &hdr)];
                dec.write_record(&out, i, &hdr, &mut rec);
                for e in KvEventBatch::decode(&rec[..]).unwrap().events {
                    if let Some(Data::Stored(s)) = e.data {
                        read.push((s.parent_block_hash, s.blocks));
                    }
                }
            }
            let parents: Vec<_> = read.iter().map(|r| r.0).collect();
            assert_eq!(parents, [Some(9), Some(2)], "{layout:?}");
            let blocks: Vec<_> = read
                .iter()
                .flat_map(|r| &r.1)
                .map(|k| (k.block_hash, k.token_ids.clone(), k.block_size))
                .collect();
            let want: Vec<_> = chain
                .iter()
                .map(|k| (k.block_hash, k.token_ids.clone(), k.block_size))
                .collect();
            assert_eq!(blocks, want, "{layout:?}");
        }
    }

    #[test]
    fn small_hashes_stay_eight_bytes_wide() {
        let mut b = batch();
        b.events.truncate(2);
        if let Some(Data::Removed(r)) = &mut b.events[1].data {
            r.block_hashes = vec![5, -1];
        }
        let mut out = Vec::new();
        encode_batch(&b, 3, WireLayout::Map, HashForm::Unsigned, &mut out);
        let h = hex(&out);
        assert!(h.contains("92cf0000000000000005cfffffffffffffffff"), "{h}");
        assert!(h.ends_with("03"), "the rank: {h}");
    }
}
