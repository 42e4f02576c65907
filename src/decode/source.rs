//! The decoder's side of the ring contract: a planned engine batch and a synthesized `cleared`
//! batch, each a [`RecordSource`] the ring publishes without knowing how records are encoded.

use std::cell::RefCell;

use super::{encode_cleared, BatchPlan, Decoder};
use crate::ring::{EventVisitor, RecordHeader, RecordSource};
use bytes::Bytes;

/// A batch planned by [`Decoder::plan`], ready to be written into ring records (pass 2).
pub struct PlannedBatch<'a> {
    dec: &'a Decoder,
    plan: &'a BatchPlan,
    payload: &'a [u8],
}

impl Decoder {
    /// The last plan's records as a [`RecordSource`]; `payload` must be the bytes given to
    /// [`plan`](Decoder::plan).
    pub fn planned<'a>(&'a self, plan: &'a BatchPlan, payload: &'a [u8]) -> PlannedBatch<'a> {
        PlannedBatch {
            dec: self,
            plan,
            payload,
        }
    }
}

impl RecordSource for PlannedBatch<'_> {
    fn records(&self) -> usize {
        self.plan.records
    }
    fn record_len(&self, i: usize, hdr: &RecordHeader) -> usize {
        self.dec.record_len(i, hdr)
    }
    fn write_record(&self, i: usize, hdr: &RecordHeader, out: &mut [u8]) -> usize {
        self.dec.write_record(self.payload, i, hdr, out)
    }
    fn record_events(&self, i: usize) -> u64 {
        self.dec.record_events(i)
    }
    fn visit(&self, records: &[Bytes], v: &mut dyn EventVisitor) {
        self.dec.visit_plan(self.payload, records, v);
    }
}

/// A synthesized batch of one `cleared` event (engine restart, unfillable gap, undecodable
/// input: docs/smg-api.md §6.4) with timestamp `ts`. Rare, so it encodes into a scratch buffer.
pub struct ClearedBatch {
    ts: f64,
    scratch: RefCell<Vec<u8>>,
}

impl ClearedBatch {
    /// A clear stamped `ts` (Unix seconds).
    pub fn new(ts: f64) -> Self {
        ClearedBatch {
            ts,
            scratch: RefCell::new(Vec::with_capacity(48)),
        }
    }
}

impl RecordSource for ClearedBatch {
    fn records(&self) -> usize {
        1
    }
    fn record_len(&self, _i: usize, hdr: &RecordHeader) -> usize {
        encode_cleared(hdr, self.ts, &mut self.scratch.borrow_mut())
    }
    fn write_record(&self, _i: usize, hdr: &RecordHeader, out: &mut [u8]) -> usize {
        let mut buf = self.scratch.borrow_mut();
        let len = encode_cleared(hdr, self.ts, &mut buf);
        out[..len].copy_from_slice(&buf[..len]);
        len
    }
    fn record_events(&self, _i: usize) -> u64 {
        1
    }
    fn visit(&self, _records: &[Bytes], v: &mut dyn EventVisitor) {
        v.cleared();
    }
}
