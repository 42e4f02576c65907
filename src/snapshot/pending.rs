//! What ingest publishes while the table's image is being copied: kept aside and applied after
//! the copy, so that the copy (131 ms at 1,000,000 blocks) never holds ingest.
//!
//! A published source's events reference the decoder's scratch and the records just written,
//! which are reused by the next batch; [`Recorder`] therefore copies what the table needs (a
//! store's attribute bytes, each block's hash and wire bytes, a removal's hashes) into a
//! [`Logged`] source, and [`Logged::replay`] shows the same events to the table later. Blocks are
//! already encoded, so recording one is a copy. Allocation happens only while a copy runs.
use crate::ring::{EventVisitor, RecordSource, StoredEvent};
use bytes::Bytes;

/// A recorded store, shown to the table as the decoder's stores are.
struct Stored {
    parent: Option<i64>,
    tier: Option<i32>,
    group: Option<u32>,
    attrs: Vec<u8>,
    hashes: Vec<i64>,
    /// Block `i` is `blocks[ends[i - 1] .. ends[i]]` (from 0 for the first).
    blocks: Vec<u8>,
    ends: Vec<usize>,
}

/// One recorded event.
enum Event {
    Stored(Stored),
    Removed {
        hashes: Vec<i64>,
        tier: Option<i32>,
        group: Option<u32>,
    },
    Cleared,
}

/// A published source, recorded: its events, its rank and the records that held them.
pub(super) struct Logged {
    pub(super) rank: u32,
    pub(super) first: u64,
    pub(super) last: u64,
    events: Vec<Event>,
}

impl Logged {
    /// Records the events of `src`, published as `records` ending at `last_seq` from `rank`
    /// (the arguments of [`Table::apply`](super::Table::apply), applied later by `replay`).
    pub(super) fn record(
        src: &dyn RecordSource,
        records: &[Bytes],
        rank: u32,
        last_seq: u64,
    ) -> Self {
        let mut r = Recorder(Vec::new());
        src.visit(records, &mut r);
        Logged {
            rank,
            first: super::table::first_record(src, last_seq),
            last: last_seq,
            events: r.0,
        }
    }

    /// Shows the recorded events to `v`, in order.
    pub(super) fn replay(&self, v: &mut dyn EventVisitor) {
        for e in &self.events {
            match e {
                Event::Stored(st) => v.stored(st),
                Event::Removed {
                    hashes,
                    tier,
                    group,
                } => v.removed(hashes, *tier, *group),
                Event::Cleared => v.cleared(),
            }
        }
    }
}

struct Recorder(Vec<Event>);

impl EventVisitor for Recorder {
    fn stored(&mut self, ev: &dyn StoredEvent) {
        let n = ev.blocks();
        let mut attrs = Vec::new();
        ev.write_attrs(&mut attrs);
        let (mut hashes, mut blocks, mut ends) =
            (Vec::with_capacity(n), Vec::new(), Vec::with_capacity(n));
        for i in 0..n {
            hashes.push(ev.hash(i));
            ev.write_block(i, &mut blocks);
            ends.push(blocks.len());
        }
        self.0.push(Event::Stored(Stored {
            parent: ev.parent(),
            tier: ev.tier(),
            group: ev.group(),
            attrs,
            hashes,
            blocks,
            ends,
        }));
    }
    fn removed(&mut self, hashes: &[i64], tier: Option<i32>, group: Option<u32>) {
        self.0.push(Event::Removed {
            hashes: hashes.to_vec(),
            tier,
            group,
        });
    }
    fn cleared(&mut self) {
        self.0.push(Event::Cleared);
    }
}

impl StoredEvent for Stored {
    fn parent(&self) -> Option<i64> {
        self.parent
    }
    fn tier(&self) -> Option<i32> {
        self.tier
    }
    fn group(&self) -> Option<u32> {
        self.group
    }
    fn blocks(&self) -> usize {
        self.hashes.len()
    }
    fn hash(&self, i: usize) -> i64 {
        self.hashes[i]
    }
    fn write_attrs(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.attrs);
    }
    fn write_block(&self, i: usize, out: &mut Vec<u8>) {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        out.extend_from_slice(&self.blocks[start..self.ends[i]]);
    }
}
