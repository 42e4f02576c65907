//! Pass 1, last step: cut the kept events into records of at most `split_threshold` bytes for
//! any header. Events are packed in order; an event that does not fit the current record
//! starts a new one; one that does not fit an empty record is split at block (store) or hash
//! (removal) boundaries into parts of one chain; one whose single block or hash cannot fit an
//! empty record is dropped and counted. Sizes are the exact `*_len`s of `encode.rs`, bounded
//! with [`REC_OVERHEAD_MAX`] and [`entry_bound`] so the cut holds for any record header.
use super::encode::{entry_bound, hashes_len, parent_len, REC_OVERHEAD_MAX};
use super::pb::{ld, vlen};
use super::scratch::{Ev, EvKind, Part, Rec};
use super::Decoder;

impl Decoder {
    /// Adds the last kept event (`evs.last()`, its blocks already measured, its hashes at
    /// `hmark..`) as one part or, split, several. Drops (and counts) an event whose smallest
    /// part cannot fit into an empty record.
    pub(crate) fn pack(&mut self, hmark: usize) {
        let ei = self.evs.len() - 1;
        let ev = &self.evs[ei];
        let (kind, n, blk_start) = (ev.kind, ev.n, ev.blk_start);
        let (whole, unit_max) = self.event_sizes(ev);
        let thr = self.cfg.split_threshold;
        let room = thr.saturating_sub(REC_OVERHEAD_MAX);
        let eb = entry_bound(whole);
        let fits_open = self.open && self.used + eb <= thr;
        if fits_open || eb <= room {
            if !fits_open {
                self.open = false;
            }
            self.push_part(ei as u32, 0, n, whole, eb);
            return;
        }
        if entry_bound(unit_max) > room {
            self.stats.oversized_events += 1;
            if kind == EvKind::Stored {
                self.blocks.truncate(blk_start as usize);
            }
            if kind == EvKind::Removed {
                self.lost_removals += 1;
            }
            self.hashes.truncate(hmark);
            self.evs.pop();
            return;
        }
        self.stats.split_events += 1;
        self.split(ei as u32, n);
    }

    /// The `data` body size of the whole event, and of its largest one-block (one-hash) part.
    fn event_sizes(&self, ev: &Ev) -> (usize, usize) {
        let fixed = ev.fixed_len as usize;
        match ev.kind {
            EvKind::Stored => {
                let mut s = 0usize;
                let mut mx = 0usize;
                for i in 0..ev.n {
                    let e = self.block_entry_len(ev, i);
                    s += e;
                    mx = mx.max(e);
                }
                // a part's parent is at most 11 bytes
                (
                    fixed + parent_len(self.part_parent(ev, 0)) + s,
                    fixed + 11 + mx,
                )
            }
            // a hash is at most a 10-byte varint
            EvKind::Removed => (fixed + hashes_len(ev.packed as usize), fixed + ld(10)),
            EvKind::Cleared => (fixed, fixed),
        }
    }

    /// Emits `evs[ei]` (of `n` blocks / hashes) in parts at block / hash boundaries, each as
    /// large as what is left of the open record allows (a fresh record when nothing fits).
    fn split(&mut self, ei: u32, n: u32) {
        let thr = self.cfg.split_threshold;
        let mut lo = 0u32;
        while lo < n {
            if !self.open {
                self.open_record();
            }
            let (hi, d) = self.fit(&self.evs[ei as usize], lo, thr - self.used);
            if hi == lo {
                // nothing fits in what is left of this record: start a fresh one
                self.open = false;
                continue;
            }
            self.push_part(ei, lo, hi, d, entry_bound(d));
            lo = hi;
            if lo < n {
                self.open = false;
            }
        }
    }

    /// The longest part of `ev` from `lo` whose entry bound fits in `avail` bytes: its end
    /// and its `data` body size.
    fn fit(&self, ev: &Ev, lo: u32, avail: usize) -> (u32, usize) {
        let fixed = ev.fixed_len as usize;
        let mut hi = lo;
        let mut d;
        match ev.kind {
            EvKind::Stored => {
                d = fixed + parent_len(self.part_parent(ev, lo));
                while hi < ev.n {
                    let nd = d + self.block_entry_len(ev, hi);
                    if entry_bound(nd) > avail {
                        break;
                    }
                    d = nd;
                    hi += 1;
                }
            }
            _ => {
                let mut packed = 0usize;
                d = fixed;
                while hi < ev.n {
                    let np = packed + vlen(self.hashes[(ev.hash_start + hi) as usize] as u64);
                    let nd = fixed + hashes_len(np);
                    if entry_bound(nd) > avail {
                        break;
                    }
                    packed = np;
                    d = nd;
                    hi += 1;
                }
            }
        }
        (hi, d)
    }

    fn open_record(&mut self) {
        self.recs.push(Rec {
            p0: self.parts.len() as u32,
            p1: self.parts.len() as u32,
        });
        self.used = REC_OVERHEAD_MAX;
        self.open = true;
    }

    /// Appends a part of `d` body bytes (entry bound `eb`) to the open record, opening one if
    /// none is.
    fn push_part(&mut self, ev: u32, lo: u32, hi: u32, d: usize, eb: usize) {
        if !self.open {
            self.open_record();
        }
        self.parts.push(Part {
            ev,
            lo,
            hi,
            data_len: d as u32,
        });
        self.recs.last_mut().expect("open record").p1 += 1;
        self.used += eb;
    }
}
