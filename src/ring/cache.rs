//! The most recent records as shared [`Bytes`], indexed by sequence number.
//!
//! Why a cache beside the ring: a record in shared memory can be overwritten while a reader
//! copies it, so every in-process subscriber would need its own validated copy. Copying once at
//! commit time into a reference-counted buffer lets thousands of live subscribers share it.
//!
//! The copy is made as the gRPC edge sends it: one length-prefixed gRPC message (the 5-byte
//! prefix, then the record), since that edge is the cache's only reader. Every subscriber then
//! hands the same buffer to its HTTP/2 stream, with no per-subscriber framing or copy.

use std::collections::VecDeque;

use bytes::Bytes;

/// At most this many records are cached.
pub(super) const CACHE_MAX_ITEMS: usize = 8192;
/// At most this many bytes are cached (and never more than a quarter of the ring).
pub(super) const CACHE_MAX_BYTES: usize = 32 << 20;

/// Bytes of the gRPC message prefix: a compression flag (0) and the length (big-endian u32).
pub const GRPC_PREFIX_LEN: usize = 5;

/// `record` as one uncompressed length-prefixed gRPC message (gRPC over HTTP/2,
/// "Length-Prefixed-Message"), in one allocation.
pub fn grpc_framed(record: &[u8]) -> Bytes {
    let len = u32::try_from(record.len()).expect("records are far below 4 GiB");
    let mut v = Vec::with_capacity(GRPC_PREFIX_LEN + record.len());
    v.push(0);
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(record);
    Bytes::from(v)
}

/// Contiguous records `first_seq ..` with their ingest time (Unix ns).
#[derive(Default)]
pub(super) struct RecentCache {
    first_seq: u64,
    items: VecDeque<(Bytes, u64)>,
    bytes: usize,
}

impl RecentCache {
    /// Appends record `seq`; a discontinuity restarts the cache instead of mis-indexing.
    pub(super) fn push(&mut self, seq: u64, b: Bytes, ingest_ns: u64, max_bytes: usize) {
        if self.items.is_empty() || seq != self.first_seq + self.items.len() as u64 {
            self.items.clear();
            self.bytes = 0;
            self.first_seq = seq;
        }
        self.bytes += b.len();
        self.items.push_back((b, ingest_ns));
        while self.items.len() > CACHE_MAX_ITEMS || (self.bytes > max_bytes && self.items.len() > 1)
        {
            if let Some((old, _)) = self.items.pop_front() {
                self.bytes -= old.len();
                self.first_seq += 1;
            }
        }
    }

    /// Record `seq` and its ingest time, if cached.
    pub(super) fn get(&self, seq: u64) -> Option<(Bytes, u64)> {
        let i = seq.checked_sub(self.first_seq)?;
        self.items.get(i as usize).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_by_seq_and_evicts() {
        let mut c = RecentCache::default();
        let get = |c: &RecentCache, s| c.get(s).map(|(b, _)| b);
        for s in 10..10 + CACHE_MAX_ITEMS as u64 + 5 {
            c.push(s, Bytes::from(s.to_le_bytes().to_vec()), 0, CACHE_MAX_BYTES);
        }
        assert!(get(&c, 10).is_none());
        assert_eq!(get(&c, 15).unwrap().as_ref(), &15u64.to_le_bytes());
        let last = 10 + CACHE_MAX_ITEMS as u64 + 4;
        assert_eq!(get(&c, last).unwrap().as_ref(), &last.to_le_bytes());
        assert!(get(&c, last + 1).is_none());
        // A discontinuity restarts the cache instead of mis-indexing.
        c.push(last + 10, Bytes::from_static(b"x"), 0, CACHE_MAX_BYTES);
        assert!(get(&c, last).is_none());
        assert_eq!(get(&c, last + 10).unwrap().as_ref(), b"x");
    }
}
