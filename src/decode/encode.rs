//! Protobuf encoding of the SMG messages, written straight into the caller's slice.
//!
//! For each message, its exact encoded length (`*_len`: measured in pass 1, summed by
//! `record_len`) sits right next to its writer (`write_*`: pass 2), so the two can be checked
//! against each other field by field. The output is canonical — field order, minimal varints,
//! packed repeated scalars, proto3 default elision — the exact bytes prost produces for the same
//! message. Tags are named in [`super::pb::tag`].
//!
//! Splitting needs sizes that hold for *any* record header; those upper bounds
//! ([`REC_OVERHEAD_MAX`], [`entry_bound`]) sit beside the exact lengths they bound.
use super::ekeys::Key;
use super::enums::{Locality, Tier};
use super::pb::{int32, ld, opt_varint_len, tag, vlen, W};
use super::reader::read_token;
use super::scratch::{Ev, EvKind, Part, Span};
use super::{Decoder, RecordHeader};

/// Size of an optional string field; 0 when absent.
#[inline]
fn opt_str_len(s: Option<Span>) -> usize {
    s.map_or(0, |s| ld(s.len as usize))
}

#[inline]
fn write_opt_str(w: &mut W<'_>, tag: u8, s: Option<Span>, buf: &[u8]) {
    if let Some(s) = s {
        w.ld_bytes(tag, s.get(buf));
    }
}

/// An optional `KvCacheTier` / `cache_level` / `KvCacheLocality` as a varint field value.
#[inline]
fn opt_i32(v: Option<i32>) -> Option<u64> {
    v.map(int32)
}

// ------------------------------------------------------------------------------ KvEventBatch

/// Worst-case `KvEventBatch` bytes outside `events`: sequence_number (1 + 10), timestamp
/// (1 + 8), dp_rank (1 + 10). Records are cut against this bound, so any header fits.
pub(crate) const REC_OVERHEAD_MAX: usize = 31;

/// Exact length of a `KvEventBatch` with these header values and `events` entries
/// (`events_len` bytes, each entry tag + length + `KvCacheEvent`).
pub(crate) fn batch_len(hdr: &RecordHeader, ts: f64, events_len: usize) -> usize {
    (if hdr.sequence_number != 0 {
        1 + vlen(hdr.sequence_number)
    } else {
        0
    }) + (if ts != 0.0 { 9 } else { 0 })
        + events_len
        + hdr.dp_rank.map_or(0, |r| 1 + vlen(int32(r)))
}

/// The `KvEventBatch` fields before `events`.
pub(crate) fn write_batch_head(w: &mut W<'_>, hdr: &RecordHeader, ts: f64) {
    if hdr.sequence_number != 0 {
        w.field_varint(tag::KV_EVENT_BATCH_SEQUENCE_NUMBER, hdr.sequence_number);
    }
    if ts != 0.0 {
        w.u8(tag::KV_EVENT_BATCH_TIMESTAMP);
        w.bytes(&ts.to_bits().to_le_bytes());
    }
}

/// The `KvEventBatch` fields after `events`.
pub(crate) fn write_batch_tail(w: &mut W<'_>, hdr: &RecordHeader) {
    w.opt_varint(tag::KV_EVENT_BATCH_DP_RANK, hdr.dp_rank.map(int32));
}

impl Decoder {
    /// Exact length of record `i` (a `KvEventBatch` of its parts) with this header.
    pub(crate) fn rec_len(&self, i: usize, hdr: &RecordHeader) -> usize {
        let r = self.recs[i];
        let mut events = 0usize;
        for (k, p) in self.parts[r.p0 as usize..r.p1 as usize].iter().enumerate() {
            let eid = hdr.first_event_id.wrapping_add(k as u64);
            events += ld(event_len(eid, p.data_len as usize));
        }
        batch_len(hdr, self.ts, events)
    }

    /// Writes record `i`.
    pub(crate) fn write_rec(&self, buf: &[u8], i: usize, hdr: &RecordHeader, w: &mut W<'_>) {
        let r = self.recs[i];
        write_batch_head(w, hdr, self.ts);
        for (k, p) in self.parts[r.p0 as usize..r.p1 as usize].iter().enumerate() {
            let eid = hdr.first_event_id.wrapping_add(k as u64);
            w.u8(tag::KV_EVENT_BATCH_EVENTS);
            w.varint(event_len(eid, p.data_len as usize) as u64);
            self.write_event(buf, eid, p, w);
        }
        write_batch_tail(w, hdr);
    }
}

// ------------------------------------------------------------------------------ KvCacheEvent

/// Upper bound of the bytes of one `events` entry whose `data` body is `d` (< 2^32) bytes:
/// tag 1 + length ≤ 5 + event_id ≤ 1 + 10 + data tag 1 + length ≤ 5 + `d`. A closed form
/// instead of the exact varint sizes ([`event_len`]) keeps pass 1 free of dependent size chains;
/// it only makes cuts a few bytes more conservative.
#[inline(always)]
pub(crate) fn entry_bound(d: usize) -> usize {
    d + 23
}

/// Exact length of a `KvCacheEvent` body: `event_id` + the `data` field of `d` bytes.
#[inline]
pub(crate) fn event_len(eid: u64, d: usize) -> usize {
    (if eid != 0 { 1 + vlen(eid) } else { 0 }) + ld(d)
}

impl Decoder {
    fn write_event(&self, buf: &[u8], eid: u64, p: &Part, w: &mut W<'_>) {
        if eid != 0 {
            w.field_varint(tag::KV_CACHE_EVENT_EVENT_ID, eid);
        }
        let ev = &self.evs[p.ev as usize];
        let data = match ev.kind {
            EvKind::Stored => tag::KV_CACHE_EVENT_STORED,
            EvKind::Removed => tag::KV_CACHE_EVENT_REMOVED,
            EvKind::Cleared => tag::KV_CACHE_EVENT_CLEARED,
        };
        let d = p.data_len as usize;
        w.u8(data);
        w.varint(d as u64);
        let start = w.pos;
        match ev.kind {
            EvKind::Stored => self.write_stored(buf, ev, p, w),
            EvKind::Removed => self.write_removed(ev, p, buf, w),
            EvKind::Cleared => write_cleared(w, ev, buf),
        }
        debug_assert_eq!(w.pos - start, d);
    }
}

// ---------------------------------------------------------------------------- KvBlocksStored
//
// The body of a part holding blocks `lo..hi` is
// `stored_fixed_len + parent_len(part_parent(lo)) + Σ block_entry_len(i)`; pack.rs adds it up
// block by block to find the cuts.

/// `KvBlocksStored` fields 3–12 (all but `blocks` and `parent_block_hash`): repeated in every
/// part of a split store.
pub(crate) fn stored_fixed_len(ev: &Ev) -> usize {
    opt_varint_len(opt_i32(ev.tier.map(Tier::value)))
        + opt_str_len(ev.medium)
        + opt_varint_len(ev.group_idx.map(u64::from))
        + opt_str_len(ev.spec_kind)
        + opt_varint_len(ev.sliding.map(u64::from))
        + opt_varint_len(opt_i32(ev.locality.map(Locality::value)))
        + opt_str_len(ev.ownership)
        + opt_str_len(ev.session_id)
        + opt_str_len(ev.lora_name)
        + opt_str_len(ev.cache_salt)
}

/// `parent_block_hash` field size.
#[inline]
pub(crate) fn parent_len(parent: Option<i64>) -> usize {
    opt_varint_len(parent.map(|v| v as u64))
}

impl Decoder {
    /// `parent_block_hash` of the part of `ev` starting at block `lo`: the event's own parent
    /// for the first part, else the hash of the block before `lo` (one chain).
    #[inline]
    pub(crate) fn part_parent(&self, ev: &Ev, lo: u32) -> Option<i64> {
        if lo == 0 {
            ev.parent
        } else {
            Some(self.hashes[(ev.hash_start + lo - 1) as usize])
        }
    }

    /// Size of block `i` of `ev` as a `blocks` entry (tag + length + `KvBlock`).
    #[inline]
    pub(crate) fn block_entry_len(&self, ev: &Ev, i: u32) -> usize {
        ld(self.blocks[(ev.blk_start + i) as usize].body_len as usize)
    }

    fn write_stored(&self, buf: &[u8], ev: &Ev, p: &Part, w: &mut W<'_>) {
        let rec = (self.cur_rec.get() as u64) << 32;
        for i in p.lo..p.hi {
            self.block_at[(ev.blk_start + i) as usize].set(rec | w.pos as u64);
            self.write_block(buf, ev, i, w);
        }
        let parent = self.part_parent(ev, p.lo);
        w.opt_varint(
            tag::KV_BLOCKS_STORED_PARENT_BLOCK_HASH,
            parent.map(|v| v as u64),
        );
        write_stored_fixed(w, ev, buf);
    }
}

/// The fields of [`stored_fixed_len`] (`KvBlocksStored` 3–12), in field order.
pub(crate) fn write_stored_fixed(w: &mut W<'_>, ev: &Ev, buf: &[u8]) {
    {
        w.opt_varint(
            tag::KV_BLOCKS_STORED_TIER,
            opt_i32(ev.tier.map(Tier::value)),
        );
        write_opt_str(w, tag::KV_BLOCKS_STORED_MEDIUM, ev.medium, buf);
        w.opt_varint(tag::KV_BLOCKS_STORED_GROUP_IDX, ev.group_idx.map(u64::from));
        write_opt_str(
            w,
            tag::KV_BLOCKS_STORED_KV_CACHE_SPEC_KIND,
            ev.spec_kind,
            buf,
        );
        w.opt_varint(
            tag::KV_BLOCKS_STORED_KV_CACHE_SPEC_SLIDING_WINDOW,
            ev.sliding.map(u64::from),
        );
        w.opt_varint(
            tag::KV_BLOCKS_STORED_LOCALITY,
            opt_i32(ev.locality.map(Locality::value)),
        );
        write_opt_str(w, tag::KV_BLOCKS_STORED_OWNERSHIP, ev.ownership, buf);
        write_opt_str(w, tag::KV_BLOCKS_STORED_SESSION_ID, ev.session_id, buf);
        write_opt_str(w, tag::KV_BLOCKS_STORED_LORA_NAME, ev.lora_name, buf);
        write_opt_str(w, tag::KV_BLOCKS_STORED_CACHE_SALT, ev.cache_salt, buf);
    }
}

// ----------------------------------------------------------------------------------- KvBlock
//
// A block's body is `block_len(hash, tok_bytes, block_shared_len(ev))`, plus
// `extra_key_entry_len` for each of its extra keys (added once they are walked).

/// `KvBlock` fields 3–5, the same on every block of a store: `block_size`, `lora_id`,
/// `cache_level`.
#[inline]
pub(crate) fn block_shared_len(ev: &Ev) -> usize {
    opt_varint_len((ev.block_size != 0).then_some(int32(ev.block_size)))
        + opt_varint_len(ev.lora_id.map(|v| v as u64))
        + opt_varint_len(opt_i32(ev.tier.map(Tier::cache_level)))
}

/// `KvBlock` body without `extra_keys`: `block_hash`, packed `token_ids` of `tok_bytes` bytes
/// (0 = none: hash-only), and the `shared` fields.
#[inline(always)]
pub(crate) fn block_len(hash: i64, tok_bytes: usize, shared: usize) -> usize {
    (if hash != 0 { 1 + vlen(hash as u64) } else { 0 })
        + (if tok_bytes > 0 { ld(tok_bytes) } else { 0 })
        + shared
}

impl Decoder {
    /// Block `i` of `ev` as a `blocks` entry.
    #[inline]
    pub(crate) fn write_block(&self, buf: &[u8], ev: &Ev, i: u32, w: &mut W<'_>) {
        let b = self.blocks[(ev.blk_start + i) as usize];
        let h = self.hashes[(ev.hash_start + i) as usize];
        w.u8(tag::KV_BLOCKS_STORED_BLOCKS);
        w.varint(b.body_len as u64);
        if h != 0 {
            w.field_varint(tag::KV_BLOCK_BLOCK_HASH, h as u64);
        }
        if b.tok_bytes > 0 {
            w.u8(tag::KV_BLOCK_TOKEN_IDS);
            w.varint(b.tok_bytes as u64);
            let mut pos = b.tok_off as usize;
            for _ in 0..ev.block_size {
                let v = read_token(buf, &mut pos).expect("token validated by plan");
                w.varint(v as u64);
            }
        }
        // the fields of `block_shared_len`
        if ev.block_size != 0 {
            w.field_varint(tag::KV_BLOCK_BLOCK_SIZE, int32(ev.block_size));
        }
        w.opt_varint(tag::KV_BLOCK_LORA_ID, ev.lora_id.map(|v| v as u64));
        w.opt_varint(
            tag::KV_BLOCK_CACHE_LEVEL,
            opt_i32(ev.tier.map(Tier::cache_level)),
        );
        if b.ek_off != 0 {
            super::ekeys::walk(buf, b.ek_off as usize, &mut |k| write_extra_key(w, k));
        }
    }
}

// ------------------------------------------------------------- KvBlockExtraKey, KvMultimodalKey

/// Body length of a `KvBlockExtraKey`.
#[inline]
fn extra_key_len(k: Key<'_>) -> usize {
    match k {
        Key::Text(s) | Key::Blob(s) => ld(s.len()),
        Key::Number(n) => 1 + vlen(n as u64),
        Key::Mm(id, off) => ld(multimodal_len(id, off)),
    }
}

/// Size of a key as an `extra_keys` entry of `KvBlock` (tag + length + body).
#[inline]
pub(crate) fn extra_key_entry_len(k: Key<'_>) -> usize {
    ld(extra_key_len(k))
}

/// A key as an `extra_keys` entry.
fn write_extra_key(w: &mut W<'_>, k: Key<'_>) {
    w.u8(tag::KV_BLOCK_EXTRA_KEYS);
    w.varint(extra_key_len(k) as u64);
    match k {
        Key::Text(s) => w.ld_bytes(tag::KV_BLOCK_EXTRA_KEY_TEXT, s),
        Key::Blob(s) => w.ld_bytes(tag::KV_BLOCK_EXTRA_KEY_BLOB, s),
        Key::Number(n) => w.field_varint(tag::KV_BLOCK_EXTRA_KEY_NUMBER, n as u64),
        Key::Mm(id, off) => {
            w.u8(tag::KV_BLOCK_EXTRA_KEY_MULTIMODAL);
            w.varint(multimodal_len(id, off) as u64);
            write_multimodal(w, id, off);
        }
    }
}

/// Body length of a `KvMultimodalKey`.
#[inline]
fn multimodal_len(id: &[u8], off: i64) -> usize {
    (if id.is_empty() { 0 } else { ld(id.len()) }) + if off != 0 { 1 + vlen(off as u64) } else { 0 }
}

fn write_multimodal(w: &mut W<'_>, id: &[u8], off: i64) {
    if !id.is_empty() {
        w.ld_bytes(tag::KV_MULTIMODAL_KEY_IDENTIFIER, id);
    }
    if off != 0 {
        w.field_varint(tag::KV_MULTIMODAL_KEY_OFFSET, off as u64);
    }
}

// --------------------------------------------------------------------------- KvBlocksRemoved
//
// The body of a part holding hashes `lo..hi` is
// `removed_fixed_len + hashes_len(Σ vlen(hash))`; pack.rs adds it up hash by hash.

/// `KvBlocksRemoved` fields 2–7 (all but `block_hashes`): repeated in every part.
pub(crate) fn removed_fixed_len(ev: &Ev) -> usize {
    opt_varint_len(opt_i32(ev.tier.map(Tier::cache_level)))
        + opt_varint_len(opt_i32(ev.tier.map(Tier::value)))
        + opt_str_len(ev.medium)
        + opt_varint_len(ev.group_idx.map(u64::from))
        + opt_varint_len(opt_i32(ev.locality.map(Locality::value)))
        + opt_str_len(ev.ownership)
}

/// The packed `block_hashes` field holding `packed` bytes of varints.
#[inline]
pub(crate) fn hashes_len(packed: usize) -> usize {
    if packed > 0 {
        ld(packed)
    } else {
        0
    }
}

impl Decoder {
    fn write_removed(&self, ev: &Ev, p: &Part, buf: &[u8], w: &mut W<'_>) {
        let hs = &self.hashes[(ev.hash_start + p.lo) as usize..(ev.hash_start + p.hi) as usize];
        let packed: usize = hs.iter().map(|&h| vlen(h as u64)).sum();
        if packed > 0 {
            w.u8(tag::KV_BLOCKS_REMOVED_BLOCK_HASHES);
            w.varint(packed as u64);
            for &h in hs {
                w.varint(h as u64);
            }
        }
        // the fields of `removed_fixed_len`
        w.opt_varint(
            tag::KV_BLOCKS_REMOVED_CACHE_LEVEL,
            opt_i32(ev.tier.map(Tier::cache_level)),
        );
        w.opt_varint(
            tag::KV_BLOCKS_REMOVED_TIER,
            opt_i32(ev.tier.map(Tier::value)),
        );
        write_opt_str(w, tag::KV_BLOCKS_REMOVED_MEDIUM, ev.medium, buf);
        w.opt_varint(
            tag::KV_BLOCKS_REMOVED_GROUP_IDX,
            ev.group_idx.map(u64::from),
        );
        w.opt_varint(
            tag::KV_BLOCKS_REMOVED_LOCALITY,
            opt_i32(ev.locality.map(Locality::value)),
        );
        write_opt_str(w, tag::KV_BLOCKS_REMOVED_OWNERSHIP, ev.ownership, buf);
    }
}

// ---------------------------------------------------------------------------- KvCacheCleared

/// `KvCacheCleared` body.
pub(crate) fn cleared_len(ev: &Ev) -> usize {
    opt_str_len(ev.ownership)
}

fn write_cleared(w: &mut W<'_>, ev: &Ev, buf: &[u8]) {
    write_opt_str(w, tag::KV_CACHE_CLEARED_OWNERSHIP, ev.ownership, buf);
}

/// A synthesized batch holding one `cleared` event without `ownership` (engine restart or
/// unfillable gap, docs/smg-api.md §6.4), with `event_id = hdr.first_event_id`. Clears `out`, writes
/// the record into it and returns its length.
pub fn encode_cleared(hdr: &RecordHeader, ts: f64, out: &mut Vec<u8>) -> usize {
    let eid = hdr.first_event_id;
    let ev = event_len(eid, 0); // `cleared {}`: an empty body
    let len = batch_len(hdr, ts, ld(ev));
    out.clear();
    out.resize(len, 0);
    let mut w = W {
        buf: &mut out[..],
        pos: 0,
    };
    write_batch_head(&mut w, hdr, ts);
    w.u8(tag::KV_EVENT_BATCH_EVENTS);
    w.varint(ev as u64);
    if eid != 0 {
        w.field_varint(tag::KV_CACHE_EVENT_EVENT_ID, eid);
    }
    w.u8(tag::KV_CACHE_EVENT_CLEARED);
    w.u8(0x00); // length 0
    write_batch_tail(&mut w, hdr);
    debug_assert_eq!(w.pos, len);
    len
}
