//! Pass 2: re-walk the payload at the offsets recorded by pass 1 and write canonical protobuf
//! (field order, minimal varints, packed repeated scalars, proto3 default elision) — the exact
//! bytes prost produces for the same message.
use super::ekeys;
use super::pb::{ld, vlen, W};
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
        w.u8(0x08);
        w.varint(hdr.sequence_number);
    }
    if ts != 0.0 {
        w.u8(0x11);
        w.bytes(&ts.to_bits().to_le_bytes());
    }
}

pub(crate) fn write_tail(w: &mut W<'_>, hdr: &RecordHeader) {
    if let Some(r) = hdr.dp_rank {
        w.u8(0x20);
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
            w.u8(0x1a);
            w.varint(event_len(eid, d) as u64);
            if eid != 0 {
                w.u8(0x08);
                w.varint(eid);
            }
            let ev = &self.evs[p.ev as usize];
            let start = w.pos;
            match ev.kind {
                EvKind::Stored => {
                    w.u8(0x12);
                    w.varint(d as u64);
                    self.write_store(buf, ev, p, w);
                }
                EvKind::Removed => {
                    w.u8(0x1a);
                    w.varint(d as u64);
                    self.write_removal(buf, ev, p, w);
                }
                EvKind::Cleared => {
                    w.u8(0x22);
                    w.varint(d as u64);
                    opt_str(w, 0x0a, ev.ownership, buf);
                }
            }
            debug_assert_eq!(w.pos - start, ld(d));
        }
        write_tail(w, hdr);
    }

    fn write_store(&self, buf: &[u8], ev: &Ev, p: &Part, w: &mut W<'_>) {
        let cl = ev.tier.map(|t| t as u64 - 1);
        for i in p.lo..p.hi {
            let b = self.blocks[(ev.blk_start + i) as usize];
            let h = self.hashes[(ev.hash_start + i) as usize];
            w.u8(0x0a);
            w.varint(b.body_len as u64);
            if h != 0 {
                w.u8(0x08);
                w.varint(h as u64);
            }
            if !ev.hash_only && b.tok_bytes > 0 {
                w.u8(0x12);
                w.varint(b.tok_bytes as u64);
                let mut pos = b.tok_off as usize;
                for _ in 0..ev.block_size {
                    let v = read_token(buf, &mut pos).expect("token validated by plan");
                    w.varint(v as u64);
                }
            }
            if ev.block_size != 0 {
                w.u8(0x18);
                w.varint(ev.block_size as i64 as u64);
            }
            opt_v(w, 0x20, ev.lora_id.map(|v| v as u64));
            opt_v(w, 0x28, cl);
            if b.ek_off != 0 {
                ekeys::walk(buf, b.ek_off as usize, &mut |k| k.write(w));
            }
        }
        let parent = if p.lo == 0 {
            ev.parent
        } else {
            Some(self.hashes[(ev.hash_start + p.lo - 1) as usize])
        };
        opt_v(w, 0x10, parent.map(|v| v as u64));
        opt_v(w, 0x18, ev.tier.map(u64::from));
        opt_str(w, 0x22, ev.medium, buf);
        opt_v(w, 0x28, ev.group_idx.map(u64::from));
        opt_str(w, 0x32, ev.spec_kind, buf);
        opt_v(w, 0x38, ev.sliding.map(u64::from));
        opt_v(w, 0x40, ev.locality.map(u64::from));
        opt_str(w, 0x4a, ev.ownership, buf);
        opt_str(w, 0x52, ev.session_id, buf);
        opt_str(w, 0x5a, ev.lora_name, buf);
        opt_str(w, 0x62, ev.cache_salt, buf);
    }

    fn write_removal(&self, buf: &[u8], ev: &Ev, p: &Part, w: &mut W<'_>) {
        let hs = &self.hashes[(ev.hash_start + p.lo) as usize..(ev.hash_start + p.hi) as usize];
        let packed: usize = hs.iter().map(|&h| vlen(h as u64)).sum();
        if packed > 0 {
            w.u8(0x0a);
            w.varint(packed as u64);
            for &h in hs {
                w.varint(h as u64);
            }
        }
        opt_v(w, 0x10, ev.tier.map(|t| t as u64 - 1));
        opt_v(w, 0x18, ev.tier.map(u64::from));
        opt_str(w, 0x22, ev.medium, buf);
        opt_v(w, 0x28, ev.group_idx.map(u64::from));
        opt_v(w, 0x30, ev.locality.map(u64::from));
        opt_str(w, 0x3a, ev.ownership, buf);
    }
}
