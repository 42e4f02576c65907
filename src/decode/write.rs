//! Pass 2: re-walk the payload at the offsets recorded by pass 1 and write canonical protobuf
//! (field order, minimal varints, packed repeated scalars, proto3 default elision) — the exact
//! bytes prost produces for the same message.
use super::ekeys;
use super::pb::{ld, tag, vlen, W};
use super::reader::read_token;
use super::{Decoder, Ev, EvKind, Part, RecordHeader, Span};

#[inline]
fn event_len(eid: u64, d: usize) -> usize {
    (if eid != 0 { 1 + vlen(eid) } else { 0 }) + ld(d)
}

/// Exact length of a `KvEventBatch` with these header values and `events` entries.
pub(crate) fn batch_len(hdr: &RecordHeader, ts: f64, events_len: usize) -> usize {
    (if hdr.sequence_number != 0 {
        1 + vlen(hdr.sequence_number)
    } else {
        0
    }) + (if ts != 0.0 { 9 } else { 0 })
        + events_len
        + hdr.dp_rank.map_or(0, |r| 1 + vlen(r as i64 as u64))
}

pub(crate) fn write_head(w: &mut W<'_>, hdr: &RecordHeader, ts: f64) {
    if hdr.sequence_number != 0 {
        w.u8(tag::KV_EVENT_BATCH_SEQUENCE_NUMBER);
        w.varint(hdr.sequence_number);
    }
    if ts != 0.0 {
        w.u8(tag::KV_EVENT_BATCH_TIMESTAMP);
        w.bytes(&ts.to_bits().to_le_bytes());
    }
}

pub(crate) fn write_tail(w: &mut W<'_>, hdr: &RecordHeader) {
    if let Some(r) = hdr.dp_rank {
        w.u8(tag::KV_EVENT_BATCH_DP_RANK);
        w.varint(r as i64 as u64);
    }
}

#[inline]
fn opt_str(w: &mut W<'_>, tag: u8, s: Option<Span>, buf: &[u8]) {
    if let Some(s) = s {
        w.ld_bytes(tag, s.get(buf));
    }
}

#[inline]
fn opt_v(w: &mut W<'_>, tag: u8, v: Option<u64>) {
    if let Some(v) = v {
        w.u8(tag);
        w.varint(v);
    }
}

impl Decoder {
    pub(crate) fn rec_len(&self, i: usize, hdr: &RecordHeader) -> usize {
        let r = self.recs[i];
        let mut ev = 0usize;
        for (k, p) in self.parts[r.p0 as usize..r.p1 as usize].iter().enumerate() {
            let eid = hdr.first_event_id.wrapping_add(k as u64);
            ev += ld(event_len(eid, p.data_len as usize));
        }
        batch_len(hdr, self.ts, ev)
    }

    pub(crate) fn write_rec(&self, buf: &[u8], i: usize, hdr: &RecordHeader, w: &mut W<'_>) {
        let r = self.recs[i];
        write_head(w, hdr, self.ts);
        for (k, p) in self.parts[r.p0 as usize..r.p1 as usize].iter().enumerate() {
            let eid = hdr.first_event_id.wrapping_add(k as u64);
            let d = p.data_len as usize;
            w.u8(tag::KV_EVENT_BATCH_EVENTS);
            w.varint(event_len(eid, d) as u64);
            if eid != 0 {
                w.u8(tag::KV_CACHE_EVENT_EVENT_ID);
                w.varint(eid);
            }
            let ev = &self.evs[p.ev as usize];
            let start = w.pos;
            match ev.kind {
                EvKind::Stored => {
                    w.u8(tag::KV_CACHE_EVENT_STORED);
                    w.varint(d as u64);
                    self.write_store(buf, ev, p, w);
                }
                EvKind::Removed => {
                    w.u8(tag::KV_CACHE_EVENT_REMOVED);
                    w.varint(d as u64);
                    self.write_removal(buf, ev, p, w);
                }
                EvKind::Cleared => {
                    w.u8(tag::KV_CACHE_EVENT_CLEARED);
                    w.varint(d as u64);
                    opt_str(w, tag::KV_CACHE_CLEARED_OWNERSHIP, ev.ownership, buf);
                }
            }
            debug_assert_eq!(w.pos - start, ld(d));
        }
        write_tail(w, hdr);
    }

    fn write_store(&self, buf: &[u8], ev: &Ev, p: &Part, w: &mut W<'_>) {
        let cl = ev.tier.map(|t| t.cache_level() as u64);
        for i in p.lo..p.hi {
            let b = self.blocks[(ev.blk_start + i) as usize];
            let h = self.hashes[(ev.hash_start + i) as usize];
            w.u8(tag::KV_BLOCKS_STORED_BLOCKS);
            w.varint(b.body_len as u64);
            if h != 0 {
                w.u8(tag::KV_BLOCK_BLOCK_HASH);
                w.varint(h as u64);
            }
            if !ev.hash_only && b.tok_bytes > 0 {
                w.u8(tag::KV_BLOCK_TOKEN_IDS);
                w.varint(b.tok_bytes as u64);
                let mut pos = b.tok_off as usize;
                for _ in 0..ev.block_size {
                    let v = read_token(buf, &mut pos).expect("token validated by plan");
                    w.varint(v as u64);
                }
            }
            if ev.block_size != 0 {
                w.u8(tag::KV_BLOCK_BLOCK_SIZE);
                w.varint(ev.block_size as i64 as u64);
            }
            opt_v(w, tag::KV_BLOCK_LORA_ID, ev.lora_id.map(|v| v as u64));
            opt_v(w, tag::KV_BLOCK_CACHE_LEVEL, cl);
            if b.ek_off != 0 {
                ekeys::walk(buf, b.ek_off as usize, &mut |k| k.write(w));
            }
        }
        let parent = if p.lo == 0 {
            ev.parent
        } else {
            Some(self.hashes[(ev.hash_start + p.lo - 1) as usize])
        };
        opt_v(
            w,
            tag::KV_BLOCKS_STORED_PARENT_BLOCK_HASH,
            parent.map(|v| v as u64),
        );
        opt_v(
            w,
            tag::KV_BLOCKS_STORED_TIER,
            ev.tier.map(|t| t.value() as u64),
        );
        opt_str(w, tag::KV_BLOCKS_STORED_MEDIUM, ev.medium, buf);
        opt_v(
            w,
            tag::KV_BLOCKS_STORED_GROUP_IDX,
            ev.group_idx.map(u64::from),
        );
        opt_str(
            w,
            tag::KV_BLOCKS_STORED_KV_CACHE_SPEC_KIND,
            ev.spec_kind,
            buf,
        );
        opt_v(
            w,
            tag::KV_BLOCKS_STORED_KV_CACHE_SPEC_SLIDING_WINDOW,
            ev.sliding.map(u64::from),
        );
        opt_v(
            w,
            tag::KV_BLOCKS_STORED_LOCALITY,
            ev.locality.map(|l| l.value() as u64),
        );
        opt_str(w, tag::KV_BLOCKS_STORED_OWNERSHIP, ev.ownership, buf);
        opt_str(w, tag::KV_BLOCKS_STORED_SESSION_ID, ev.session_id, buf);
        opt_str(w, tag::KV_BLOCKS_STORED_LORA_NAME, ev.lora_name, buf);
        opt_str(w, tag::KV_BLOCKS_STORED_CACHE_SALT, ev.cache_salt, buf);
    }

    fn write_removal(&self, buf: &[u8], ev: &Ev, p: &Part, w: &mut W<'_>) {
        let hs = &self.hashes[(ev.hash_start + p.lo) as usize..(ev.hash_start + p.hi) as usize];
        let packed: usize = hs.iter().map(|&h| vlen(h as u64)).sum();
        if packed > 0 {
            w.u8(tag::KV_BLOCKS_REMOVED_BLOCK_HASHES);
            w.varint(packed as u64);
            for &h in hs {
                w.varint(h as u64);
            }
        }
        opt_v(
            w,
            tag::KV_BLOCKS_REMOVED_CACHE_LEVEL,
            ev.tier.map(|t| t.cache_level() as u64),
        );
        opt_v(
            w,
            tag::KV_BLOCKS_REMOVED_TIER,
            ev.tier.map(|t| t.value() as u64),
        );
        opt_str(w, tag::KV_BLOCKS_REMOVED_MEDIUM, ev.medium, buf);
        opt_v(
            w,
            tag::KV_BLOCKS_REMOVED_GROUP_IDX,
            ev.group_idx.map(u64::from),
        );
        opt_v(
            w,
            tag::KV_BLOCKS_REMOVED_LOCALITY,
            ev.locality.map(|l| l.value() as u64),
        );
        opt_str(w, tag::KV_BLOCKS_REMOVED_OWNERSHIP, ev.ownership, buf);
    }
}
