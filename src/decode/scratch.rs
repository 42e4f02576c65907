//! What pass 1 leaves for pass 2: the entries of the decoder's reusable scratch vectors (spans
//! into the payload, one entry per kept event, per block, per emitted part and per record).
//! Offsets are `u32`: payloads are at most `u32::MAX` bytes.
use super::enums::{Locality, Tier};

/// A string in the payload.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Span {
    pub(crate) off: u32,
    pub(crate) len: u32,
}

impl Span {
    #[inline]
    pub(crate) fn get(self, buf: &[u8]) -> &[u8] {
        &buf[self.off as usize..(self.off + self.len) as usize]
    }
}

/// Which `KvCacheEvent.data` an event becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EvKind {
    Stored,
    Removed,
    Cleared,
}

/// One kept event (before splitting): its field values, where its hashes and blocks are in the
/// scratch, and its measured sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ev {
    pub(crate) kind: EvKind,
    pub(crate) parent: Option<i64>,
    pub(crate) tier: Option<Tier>,
    pub(crate) medium: Option<Span>,
    pub(crate) group_idx: Option<u32>,
    pub(crate) spec_kind: Option<Span>,
    pub(crate) sliding: Option<u32>,
    pub(crate) locality: Option<Locality>,
    pub(crate) ownership: Option<Span>,
    pub(crate) session_id: Option<Span>,
    pub(crate) lora_name: Option<Span>,
    pub(crate) cache_salt: Option<Span>,
    pub(crate) lora_id: Option<i64>,
    /// Written on every block; 0 = hash-only (the store's blocks carry no tokens).
    pub(crate) block_size: i32,
    /// First hash in `Decoder::hashes`.
    pub(crate) hash_start: u32,
    /// First block in `Decoder::blocks` (stores).
    pub(crate) blk_start: u32,
    /// Hashes (= blocks for stores).
    pub(crate) n: u32,
    /// Encoded bytes of the fields other than blocks+parent (stores) / hashes (removals),
    /// repeated in every part of a split event.
    pub(crate) fixed_len: u32,
    /// Removals: Σ varint sizes of all hashes.
    pub(crate) packed: u32,
}

impl Ev {
    pub(crate) const EMPTY: Ev = Ev {
        kind: EvKind::Cleared,
        parent: None,
        tier: None,
        medium: None,
        group_idx: None,
        spec_kind: None,
        sliding: None,
        locality: None,
        ownership: None,
        session_id: None,
        lora_name: None,
        cache_salt: None,
        lora_id: None,
        block_size: 0,
        hash_start: 0,
        blk_start: 0,
        n: 0,
        fixed_len: 0,
        packed: 0,
    };
}

/// Per-block measurements of pass 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockInfo {
    /// Offset of the block's first token id in the payload.
    pub(crate) tok_off: u32,
    /// Packed `token_ids` bytes (0 = hash-only).
    pub(crate) tok_bytes: u32,
    /// Offset of the block's `extra_keys` entry (0 = none).
    pub(crate) ek_off: u32,
    /// `KvBlock` body length.
    pub(crate) body_len: u32,
}

/// One emitted event: blocks/hashes `lo..hi` of `evs[ev]`, whose `KvCacheEvent.data` body is
/// `data_len` bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Part {
    pub(crate) ev: u32,
    pub(crate) lo: u32,
    pub(crate) hi: u32,
    pub(crate) data_len: u32,
}

/// Parts `p0..p1` form one record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rec {
    pub(crate) p0: u32,
    pub(crate) p1: u32,
}
