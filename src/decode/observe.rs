//! The planned batch's kept events, shown to an [`EventVisitor`] (the snapshot table) straight
//! from the scratch of pass 1: no second decode, no allocation of its own. A store's attributes
//! and blocks are written by the same functions that write the ring records (`encode.rs`), so
//! what the table keeps is byte-identical to what subscribers received.
use super::encode::{stored_fixed_len, write_stored_fixed};
use super::filter::Tier;
use super::pb::{ld, W};
use super::scratch::{Ev, EvKind};
use super::Decoder;
use crate::ring::{EventVisitor, StoredEvent};

struct StoredView<'a> {
    dec: &'a Decoder,
    ev: &'a Ev,
    payload: &'a [u8],
}

impl StoredEvent for StoredView<'_> {
    fn parent(&self) -> Option<i64> {
        self.ev.parent
    }
    fn tier(&self) -> Option<i32> {
        self.ev.tier.map(Tier::value)
    }
    fn blocks(&self) -> usize {
        self.ev.n as usize
    }
    fn hash(&self, i: usize) -> i64 {
        self.dec.hashes[self.ev.hash_start as usize + i]
    }
    fn write_attrs(&self, out: &mut Vec<u8>) {
        let len = stored_fixed_len(self.ev);
        let start = out.len();
        out.resize(start + len, 0);
        let mut w = W {
            buf: &mut out[start..],
            pos: 0,
        };
        write_stored_fixed(&mut w, self.ev, self.payload);
        debug_assert_eq!(w.pos, len);
    }
    fn write_block(&self, i: usize, out: &mut Vec<u8>) {
        let body = self.dec.blocks[self.ev.blk_start as usize + i].body_len as usize;
        let len = ld(body);
        let start = out.len();
        out.resize(start + len, 0);
        let mut w = W {
            buf: &mut out[start..],
            pos: 0,
        };
        self.dec
            .write_block(self.payload, self.ev, i as u32, &mut w);
        debug_assert_eq!(w.pos, len);
    }
}

impl Decoder {
    /// Shows the last plan's kept events to `v`, in order; `payload` must be the planned bytes.
    pub(crate) fn visit_plan(&self, payload: &[u8], v: &mut dyn EventVisitor) {
        for ev in &self.evs {
            match ev.kind {
                EvKind::Stored => v.stored(&StoredView {
                    dec: self,
                    ev,
                    payload,
                }),
                EvKind::Removed => v.removed(
                    &self.hashes[ev.hash_start as usize..(ev.hash_start + ev.n) as usize],
                    ev.tier.map(Tier::value),
                ),
                EvKind::Cleared => v.cleared(),
            }
        }
    }
}
