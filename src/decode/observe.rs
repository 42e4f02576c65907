//! The planned batch's kept events, shown to an [`EventVisitor`] (the snapshot table) straight
//! from the scratch of pass 1: no second decode, no allocation of its own. A block is copied
//! from the record pass 2 wrote it into (`Decoder::block_at` says where), so the table keeps
//! exactly the bytes subscribers received and its tokens are not encoded a second time: that
//! re-encoding was most of the table's cost on the ingest path. Without the records (a caller
//! that does not have them) a block is encoded again by the function that wrote it
//! (`encode.rs`), with the same result. A store's attributes are always encoded (a few bytes).
use super::encode::{stored_fixed_len, write_stored_fixed};
use super::enums::Tier;
use super::pb::{ld, W};
use super::scratch::{Ev, EvKind};
use super::{Decoder, NOT_WRITTEN};
use crate::ring::{EventVisitor, StoredEvent};
use bytes::Bytes;

struct StoredView<'a> {
    dec: &'a Decoder,
    ev: &'a Ev,
    payload: &'a [u8],
    records: &'a [Bytes],
}

impl StoredView<'_> {
    /// Block `i`'s `blocks` entry (`len` bytes) in the records, if pass 2 wrote it there.
    fn written(&self, i: usize, len: usize) -> Option<&[u8]> {
        let at = self.dec.block_at.get(self.ev.blk_start as usize + i)?.get();
        if at == NOT_WRITTEN {
            return None;
        }
        let off = (at & u32::MAX as u64) as usize;
        self.records.get((at >> 32) as usize)?.get(off..off + len)
    }
}

impl StoredEvent for StoredView<'_> {
    fn parent(&self) -> Option<i64> {
        self.ev.parent
    }
    fn tier(&self) -> Option<i32> {
        self.ev.tier.map(Tier::value)
    }
    fn group(&self) -> Option<u32> {
        self.ev.group_idx
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
        if let Some(bytes) = self.written(i, len) {
            out.extend_from_slice(bytes);
            return;
        }
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
    /// Shows the last plan's kept events to `v`, in order; `payload` must be the planned bytes
    /// and `records` the records written from it (record `i` at index `i`; empty: none).
    pub(crate) fn visit_plan(&self, payload: &[u8], records: &[Bytes], v: &mut dyn EventVisitor) {
        for ev in &self.evs {
            match ev.kind {
                EvKind::Stored => v.stored(&StoredView {
                    dec: self,
                    ev,
                    payload,
                    records,
                }),
                EvKind::Removed => v.removed(
                    &self.hashes[ev.hash_start as usize..(ev.hash_start + ev.n) as usize],
                    ev.tier.map(Tier::value),
                    ev.group_idx,
                ),
                EvKind::Cleared => v.cleared(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{DecodeConfig, RecordHeader};
    use kvbridge_tools::sim::{encode_batch, Layout, Workload};

    /// Every store's blocks, as the visitor gets them.
    #[derive(Default)]
    struct Blocks(Vec<Vec<u8>>);
    impl EventVisitor for Blocks {
        fn stored(&mut self, ev: &dyn StoredEvent) {
            for i in 0..ev.blocks() {
                let mut b = Vec::new();
                ev.write_block(i, &mut b);
                self.0.push(b);
            }
        }
        fn removed(&mut self, _: &[i64], _: Option<i32>, _: Option<u32>) {}
        fn cleared(&mut self) {}
    }

    /// Blocks copied out of the records equal blocks encoded again, also when events are split
    /// over several records; and they do come from the records (zeroed records give zeros).
    #[test]
    fn blocks_are_copied_from_the_records_written() {
        let mut dec = Decoder::new(DecodeConfig {
            split_threshold: 2048,
            ..DecodeConfig::default()
        });
        let mut w = Workload::new(11);
        let (mut copied_blocks, mut split) = (0, 0);
        for n in 0..300 {
            let p = encode_batch(Layout::Vllm0102, 1.7e9, &w.next_batch(), n);
            let plan = dec.plan(&p).expect("valid");
            let records: Vec<Bytes> = (0..plan.records)
                .map(|i| {
                    let hdr = RecordHeader {
                        sequence_number: n as u64 + 1,
                        first_event_id: 1,
                        dp_rank: None,
                    };
                    let mut out = vec![0; dec.record_len(i, &hdr)];
                    dec.write_record(&p, i, &hdr, &mut out);
                    Bytes::from(out)
                })
                .collect();
            let (mut copied, mut encoded, mut zeroed) =
                (Blocks::default(), Blocks::default(), Blocks::default());
            dec.visit_plan(&p, &records, &mut copied);
            dec.visit_plan(&p, &[], &mut encoded);
            let zeros: Vec<Bytes> = records
                .iter()
                .map(|r| Bytes::from(vec![0; r.len()]))
                .collect();
            dec.visit_plan(&p, &zeros, &mut zeroed);
            assert_eq!(copied.0, encoded.0, "batch {n}");
            for b in &zeroed.0 {
                assert!(
                    b.iter().all(|&x| x == 0),
                    "batch {n}: a block was not copied"
                );
            }
            copied_blocks += copied.0.len();
            split += (plan.records > 1) as usize;
        }
        assert!(
            copied_blocks > 1000,
            "the workload stored {copied_blocks} blocks"
        );
        assert!(
            split > 10,
            "only {split} batches were split over several records"
        );
    }
}
