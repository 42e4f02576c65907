//! The live block table of one ring: what the engine(s) feeding it stored and have not removed
//! or cleared, after the filter profile, with every field a store carries.
//!
//! It mirrors what a G2 gateway that followed the ring from the start holds for the worker
//! (docs/smg-api.md §4, smg 1.13 `WorkerIndexState`): blocks are pooled over the ring's ranks,
//! keyed by (`block_hash`, copy class), where the class is the tier the gateway counts copies
//! on (device — also unset —, host, and, under `--profile all`, disk and external); a second
//! store of a held (hash, class) is another physical copy (capped at [`COPIES_CAP`], as the
//! gateway caps it); a removal drops one copy of its class; a `cleared` from any rank empties the
//! table, because on a shared stream it empties the gateway's whole worker too. Per-rank block
//! counts are kept for metrics (the rank of a block's first store).
//!
//! **Memory.** Tokens dominate, so a block keeps exactly its wire form: the `KvBlocksStored.blocks`
//! entry (tag, length, `KvBlock` with packed varint tokens, `block_size`, `lora_id`,
//! `cache_level`, `extra_keys`) in one boxed slice, plus its parent, copy count, rank and the id
//! of its store's attribute set (fields 3–12 of `KvBlocksStored`, interned and reference
//! counted: thousands of blocks share a handful). [`Table::bytes`] reports what the table holds
//! (entries, slices, attribute sets), so bytes per block can be read off the metrics.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::ring::{EventVisitor, StoredEvent};

/// A multiply-rotate hasher (FxHash's): block hashes are already well mixed, and the table does
/// a lookup per stored and removed block on the ingest path, where SipHash would cost more
/// than the rest of the update. Not DoS-resistant; keys come from the engine, not the network.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8")));
        }
        for &b in chunks.remainder() {
            self.write_u64(b as u64);
        }
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn write_i64(&mut self, v: i64) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// Copies of one block per class the table (and a G2 gateway) counts; more stores are counted
/// as this many.
pub const COPIES_CAP: u8 = 8;

/// The copy class of a `KvCacheTier` value: 0 device (also unset / unspecified), 1 host,
/// 2 disk, 3 external.
pub(crate) fn class_of(tier: Option<i32>) -> u8 {
    match tier {
        Some(2) => 1,
        Some(3) => 2,
        Some(4) => 3,
        _ => 0,
    }
}

/// One held block (one class of one hash). 32 bytes: the parent is kept as a value and a flag
/// rather than an `Option<i64>` (which would pad the entry to 40 and the map's slot to 56): the
/// table's update is bound by cache misses in this map, so its slot size is its cost.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    parent: i64,
    /// The `blocks` entry, as sent (tag, length, `KvBlock`).
    pub(crate) block: Box<[u8]>,
    pub(crate) attrs: u32,
    pub(crate) rank: u16,
    pub(crate) copies: u8,
    has_parent: bool,
}

impl Entry {
    pub(crate) fn new(
        parent: Option<i64>,
        block: Box<[u8]>,
        attrs: u32,
        copies: u8,
        rank: u16,
    ) -> Self {
        Entry {
            parent: parent.unwrap_or(0),
            block,
            attrs,
            rank,
            copies,
            has_parent: parent.is_some(),
        }
    }

    /// `parent_block_hash` of the block (`None`: it starts a chain).
    pub(crate) fn parent(&self) -> Option<i64> {
        self.has_parent.then_some(self.parent)
    }
}

const _: () = assert!(std::mem::size_of::<Entry>() == 32);

/// An interned attribute set (`KvBlocksStored` fields 3–12, encoded) and how many entries use it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Attrs {
    pub(crate) bytes: Box<[u8]>,
    pub(crate) refs: u64,
}

/// Fixed per-entry cost used by [`Table::bytes`]: key, entry and the hash map's control byte,
/// at its load factor.
const ENTRY_OVERHEAD: usize =
    (std::mem::size_of::<(i64, u8)>() + std::mem::size_of::<Entry>() + 1) * 8 / 7;

/// The table of one ring.
#[derive(Debug, Default)]
pub struct Table {
    pub(crate) blocks: FastMap<(i64, u8), Entry>,
    pub(crate) attrs: Vec<Attrs>,
    attr_ids: FastMap<Box<[u8]>, u32>,
    free_attrs: Vec<u32>,
    /// Σ boxed block bytes and attribute bytes.
    heap_bytes: usize,
    /// Blocks per rank (rank of a block's first store).
    pub(crate) per_rank: Vec<u64>,
    /// Most blocks held; stores beyond it are not kept and make the table incomplete.
    pub(crate) max_blocks: usize,
    /// Sequence number of the last record whose events the table holds (the cut).
    pub(crate) cut: u64,
    /// Sequence number of the last `cleared` (or of the point the table started from empty):
    /// a window reaching back to it holds the whole state.
    pub(crate) origin: u64,
    /// Events the table could not follow since `origin` (0 = complete): sent as
    /// `unknown_before`.
    pub(crate) unknown: u64,
    /// Bumped by every change (checkpoints are written only when it moved).
    pub(crate) generation: u64,
    scratch: Vec<u8>,
    rank: u16,
}

impl Table {
    /// An empty, complete table that starts at `origin` (the ring's next or first number).
    pub fn new(max_blocks: usize, origin: u64) -> Self {
        Table {
            max_blocks,
            origin,
            cut: origin.saturating_sub(1),
            ..Default::default()
        }
    }

    /// Blocks held (each class of a hash counts once; copies do not).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes the table holds: entries (with the map's overhead), block slices, attribute sets.
    pub fn bytes(&self) -> usize {
        self.blocks.capacity() * ENTRY_OVERHEAD + self.heap_bytes
    }

    /// Blocks per rank.
    pub fn per_rank(&self) -> &[u64] {
        &self.per_rank
    }

    /// The cut: the last sequence number whose events the table holds.
    pub fn cut(&self) -> u64 {
        self.cut
    }

    /// The last clear (or start from empty) the table's state begins at.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Events missed since the origin (0 = the table is complete).
    pub fn unknown(&self) -> u64 {
        self.unknown
    }

    /// Applies one published source's events, from `rank`, written as `records` (their bytes;
    /// may be empty) ending at `last_seq` (what the ring's hook does; public for benchmarks and
    /// local tools).
    pub fn apply(
        &mut self,
        src: &dyn crate::ring::RecordSource,
        records: &[bytes::Bytes],
        rank: u32,
        last_seq: u64,
    ) {
        let first = first_record(src, last_seq);
        self.apply_with(rank, first, last_seq, &mut |v| src.visit(records, v));
    }

    /// Applies the events `show` shows, from `rank`, held by records `first ..= last`: a clear
    /// among them counts from `first` (the earliest record it can be in).
    pub(crate) fn apply_with(
        &mut self,
        rank: u32,
        first: u64,
        last: u64,
        show: &mut dyn FnMut(&mut dyn EventVisitor),
    ) {
        self.rank = rank.min(u16::MAX as u32) as u16;
        show(&mut Apply {
            t: self,
            seq: first,
        });
        self.cut = last;
        self.generation += 1;
    }

    /// The table's image (LAYOUT.md §2) appended to `out`: the copy taken under the lock.
    pub fn image(&self, out: &mut Vec<u8>) {
        self.write_image(out);
    }

    /// Marks the table as missing `n` events (input it could not follow).
    pub(crate) fn lose(&mut self, n: u64) {
        self.unknown = self.unknown.saturating_add(n.max(1));
        self.generation += 1;
    }

    /// Empties the table; its state begins again at record `seq` (complete).
    pub(crate) fn clear(&mut self, seq: u64) {
        self.blocks = FastMap::default();
        self.attrs.clear();
        self.attr_ids.clear();
        self.free_attrs.clear();
        self.heap_bytes = 0;
        self.per_rank.iter_mut().for_each(|n| *n = 0);
        self.origin = seq;
        self.unknown = 0;
        self.generation += 1;
    }

    fn intern(&mut self, bytes: &[u8]) -> u32 {
        if let Some(&id) = self.attr_ids.get(bytes) {
            return id;
        }
        let boxed: Box<[u8]> = bytes.into();
        self.heap_bytes += boxed.len() * 2 + 64;
        let id = match self.free_attrs.pop() {
            Some(id) => {
                self.attrs[id as usize] = Attrs {
                    bytes: boxed.clone(),
                    refs: 0,
                };
                id
            }
            None => {
                self.attrs.push(Attrs {
                    bytes: boxed.clone(),
                    refs: 0,
                });
                (self.attrs.len() - 1) as u32
            }
        };
        self.attr_ids.insert(boxed, id);
        id
    }

    fn release_attrs(&mut self, id: u32) {
        let a = &mut self.attrs[id as usize];
        a.refs -= 1;
        if a.refs == 0 {
            let bytes = std::mem::take(&mut a.bytes);
            self.heap_bytes -= bytes.len() * 2 + 64;
            self.attr_ids.remove(&bytes);
            self.free_attrs.push(id);
        }
    }

    /// Inserts a block (used by the checkpoint loader and the ring catch-up as well).
    pub(crate) fn insert(&mut self, hash: i64, class: u8, e: Entry) -> bool {
        if self.blocks.len() >= self.max_blocks {
            return false;
        }
        self.heap_bytes += e.block.len();
        self.attrs[e.attrs as usize].refs += 1;
        let r = e.rank as usize;
        if self.per_rank.len() <= r {
            self.per_rank.resize(r + 1, 0);
        }
        self.per_rank[r] += 1;
        self.blocks.insert((hash, class), e);
        true
    }

    fn store(&mut self, ev: &dyn StoredEvent) {
        let class = class_of(ev.tier());
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        ev.write_attrs(&mut scratch);
        let attrs = self.intern(&scratch);
        let mut lost = false;
        for i in 0..ev.blocks() {
            let hash = ev.hash(i);
            let full = self.blocks.len() >= self.max_blocks;
            // one lookup per block: the entry is either another copy or a new block
            match self.blocks.entry((hash, class)) {
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    let e = o.get_mut();
                    e.copies = (e.copies + 1).min(COPIES_CAP);
                }
                std::collections::hash_map::Entry::Vacant(_) if full => lost = true,
                std::collections::hash_map::Entry::Vacant(v) => {
                    scratch.clear();
                    ev.write_block(i, &mut scratch);
                    let parent = if i == 0 {
                        ev.parent()
                    } else {
                        Some(ev.hash(i - 1))
                    };
                    self.heap_bytes += scratch.len();
                    self.attrs[attrs as usize].refs += 1;
                    let r = self.rank as usize;
                    if self.per_rank.len() <= r {
                        self.per_rank.resize(r + 1, 0);
                    }
                    self.per_rank[r] += 1;
                    v.insert(Entry::new(
                        parent,
                        scratch.as_slice().into(),
                        attrs,
                        1,
                        self.rank,
                    ));
                }
            }
        }
        self.scratch = scratch;
        if self.attrs[attrs as usize].refs == 0 {
            // every block was a further copy (or over the bound): nothing uses the set
            self.attrs[attrs as usize].refs = 1;
            self.release_attrs(attrs);
        }
        if lost {
            self.unknown = self.unknown.saturating_add(1);
        }
    }

    /// Drops one copy of each hash in `class`.
    pub(crate) fn remove(&mut self, hashes: &[i64], class: u8) {
        for &h in hashes {
            let Some(e) = self.blocks.get_mut(&(h, class)) else {
                continue;
            };
            if e.copies > 1 {
                e.copies -= 1;
                continue;
            }
            let e = self.blocks.remove(&(h, class)).expect("present");
            self.heap_bytes -= e.block.len();
            if let Some(n) = self.per_rank.get_mut(e.rank as usize) {
                *n = n.saturating_sub(1);
            }
            self.release_attrs(e.attrs);
        }
    }

    /// Interns an attribute set (checkpoint loader, ring catch-up).
    pub(crate) fn attrs_id(&mut self, bytes: &[u8]) -> u32 {
        self.intern(bytes)
    }

    /// Drops an attribute set nothing uses (after a loader interned it for nothing).
    pub(crate) fn unused_attrs(&mut self, id: u32) {
        if self.attrs[id as usize].refs == 0 {
            self.attrs[id as usize].refs = 1;
            self.release_attrs(id);
        }
    }
}

/// The first record `src` was written as, when its last is `last_seq`: a clear among its
/// events counts from there (see [`Table::apply_with`]).
pub(crate) fn first_record(src: &dyn crate::ring::RecordSource, last_seq: u64) -> u64 {
    (last_seq + 1).saturating_sub(src.records() as u64)
}

struct Apply<'a> {
    t: &'a mut Table,
    seq: u64,
}

impl EventVisitor for Apply<'_> {
    fn stored(&mut self, ev: &dyn StoredEvent) {
        self.t.store(ev);
    }
    fn removed(&mut self, hashes: &[i64], tier: Option<i32>) {
        self.t.remove(hashes, class_of(tier));
    }
    fn cleared(&mut self) {
        self.t.clear(self.seq);
    }
}
