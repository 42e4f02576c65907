//! The live block table of one ring: what the engine(s) feeding it stored and have not removed
//! or cleared, after the filter profile, with every field a store carries.
//!
//! It mirrors what a G2 gateway that followed the ring from the start holds for the worker
//! (docs/smg-api.md §4, smg 1.13 `WorkerIndexState`): blocks are pooled over the ring's ranks,
//! keyed by (`block_hash`, copy class, KV-cache group), where the class is the tier the gateway
//! counts copies on (device — also unset —, host, and, under `--profile all`, disk and
//! external) and the group is `group_idx` (unset = 0): a hybrid model's engine stores the same
//! hash in its sliding-window and its full-attention group, and the two are separate blocks
//! with separate lives (a sliding group's removal leaves the full group's copy); a second
//! store of a held (hash, class, group) is another physical copy (capped at [`COPIES_CAP`], as
//! the gateway caps it); a removal drops one copy of its class and group; a `cleared` from any rank empties the
//! table, because on a shared stream it empties the gateway's whole worker too. Per-rank block
//! counts are kept for metrics (the rank of a block's first store).
//!
//! **Memory.** Tokens dominate, so a block keeps exactly its wire form: the `KvBlocksStored.blocks`
//! entry (tag, length, `KvBlock` with packed varint tokens, `block_size`, `lora_id`,
//! `cache_level`, `extra_keys`), back to back with the others in one arena, plus a packed
//! 31-byte map slot: hash, class, group, parent, arena offset, copy count, rank and the id of its
//! store's attribute set (fields 3–12 of `KvBlocksStored`, interned and reference counted:
//! thousands of blocks share a handful). [`Table::bytes`] reports what the table holds (slots,
//! arena, attribute sets), so bytes per block can be read off the metrics.
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

/// The table's group of a `group_idx`: unset is group 0 (an engine with one group may send it
/// on stores and not on removals); indices past `u16::MAX` share the last value.
pub(crate) fn group_of(group_idx: Option<u32>) -> u16 {
    group_idx.unwrap_or(0).min(u16::MAX as u32) as u16
}

/// The map key of a held block: its hash, copy class and group, packed into 11 bytes (an
/// aligned `(i64, u8, u16)` takes 16). The table's update is bound by cache misses in this
/// map, and at a million blocks its slots are most of the table's memory: the slot size is its
/// cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, packed)]
pub(crate) struct Key {
    hash: i64,
    class: u8,
    group: u16,
}

impl Key {
    pub(crate) fn new(hash: i64, class: u8, group: u16) -> Self {
        Key { hash, class, group }
    }
    pub(crate) fn hash(&self) -> i64 {
        self.hash
    }
    pub(crate) fn class(&self) -> u8 {
        self.class
    }
    pub(crate) fn group(&self) -> u16 {
        self.group
    }
}

impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        // one round: class and group spread over every bit, so a block's places land apart
        let (hash, class, group) = (self.hash, self.class, self.group);
        let place = (group as u64) << 8 | class as u64;
        h.write_u64(hash as u64 ^ place.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
}

/// What the map keeps of one held block, packed into 20 bytes: its parent, where its bytes are
/// in the [`Arena`] (40 bits), its attribute set, rank, copies and whether it has a parent.
/// With the key a slot is 31 bytes (an aligned layout with a boxed slice took 48, and the box's
/// own allocation 16–24 more).
#[derive(Clone, Copy, Debug)]
#[repr(C, packed)]
struct Slot {
    parent: i64,
    off_lo: u32,
    off_hi: u8,
    attrs: u32,
    rank: u16,
    /// Copies in bits 0–3, "has a parent" in bit 7.
    flags: u8,
}

const HAS_PARENT: u8 = 0x80;

const _: () = assert!(std::mem::size_of::<(Key, Slot)>() == 31);
const _: () = assert!(COPIES_CAP < 16);

impl Slot {
    fn new(parent: Option<i64>, off: u64, attrs: u32, copies: u8, rank: u16) -> Self {
        debug_assert!(off < 1 << 40);
        Slot {
            parent: parent.unwrap_or(0),
            off_lo: off as u32,
            off_hi: (off >> 32) as u8,
            attrs,
            rank,
            flags: copies.min(COPIES_CAP) | if parent.is_some() { HAS_PARENT } else { 0 },
        }
    }
    fn off(&self) -> u64 {
        self.off_lo as u64 | (self.off_hi as u64) << 32
    }
    fn set_off(&mut self, off: u64) {
        self.off_lo = off as u32;
        self.off_hi = (off >> 32) as u8;
    }
    fn copies(&self) -> u8 {
        self.flags & 0x0f
    }
    fn set_copies(&mut self, n: u8) {
        self.flags = (self.flags & HAS_PARENT) | n.min(COPIES_CAP);
    }
    fn parent(&self) -> Option<i64> {
        (self.flags & HAS_PARENT != 0).then_some(self.parent)
    }
}

/// One held block as the table shows it (and as loaders hand it in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry<'a> {
    /// `parent_block_hash` of the block (`None`: it starts a chain).
    pub(crate) parent: Option<i64>,
    /// The `blocks` entry, as sent (tag, length, `KvBlock`).
    pub(crate) block: &'a [u8],
    pub(crate) attrs: u32,
    pub(crate) rank: u16,
    pub(crate) copies: u8,
}

impl<'a> Entry<'a> {
    pub(crate) fn new(
        parent: Option<i64>,
        block: &'a [u8],
        attrs: u32,
        copies: u8,
        rank: u16,
    ) -> Self {
        Entry {
            parent,
            block,
            attrs,
            rank,
            copies,
        }
    }
}

/// The held blocks' bytes, back to back in pages of [`PAGE`] bytes, each behind its length (a
/// varint): a few large allocations instead of one per block (which cost 16–24 bytes of
/// allocator overhead each), and pages rather than one growing buffer (whose doubling leaves
/// the allocator holding the smaller copies: measured +56 B per block of RSS). A removed
/// block's bytes become a hole that the next block of exactly that length takes (block lengths
/// of one engine vary over a few values: tokens are varints); when holes are more than half
/// of the arena anyway (lengths drifted), it is compacted.
#[derive(Debug, Default)]
struct Arena {
    pages: Vec<Vec<u8>>,
    /// Σ page lengths.
    used: usize,
    /// Holes by their length (prefix included).
    holes: FastMap<u32, Vec<u64>>,
    /// Σ hole lengths, and their number.
    hole_bytes: usize,
    hole_count: usize,
}

/// Bits of an arena offset within its page; a block never straddles two pages (one longer than
/// a page gets a page of its own).
const PAGE_BITS: u32 = 20;
const PAGE: usize = 1 << PAGE_BITS;

/// Arena holes below this never trigger a compaction (small in unit tests, so that the property
/// test compacts).
const COMPACT_MIN: usize = if cfg!(test) { 256 } else { 1 << 20 };

impl Arena {
    /// Stores `block`; its offset.
    fn put(&mut self, block: &[u8]) -> u64 {
        let need = prost::encoding::encoded_len_varint(block.len() as u64) + block.len();
        if let Some(off) = self.holes.get_mut(&(need as u32)).and_then(|v| v.pop()) {
            self.hole_bytes -= need;
            self.hole_count -= 1;
            let (p, o) = split(off);
            let mut at = &mut self.pages[p][o..o + need];
            prost::encoding::encode_varint(block.len() as u64, &mut at);
            at.copy_from_slice(block);
            return off;
        }
        let room = self.pages.last().map_or(0, |p| p.capacity() - p.len());
        if room < need {
            self.pages.push(Vec::with_capacity(need.max(PAGE)));
        }
        let p = self.pages.len() - 1;
        let page = &mut self.pages[p];
        let off = ((p as u64) << PAGE_BITS) | page.len() as u64;
        prost::encoding::encode_varint(block.len() as u64, page);
        page.extend_from_slice(block);
        self.used += need;
        assert!(off < 1 << 40, "snapshot table arena over 1 TiB");
        off
    }

    /// The block stored at `off`, and the bytes it takes (prefix included).
    fn get(&self, off: u64) -> (&[u8], usize) {
        let (p, o) = split(off);
        let mut b = &self.pages[p][o..];
        let len = prost::encoding::decode_varint(&mut b).expect("an arena length") as usize;
        let prefix = prost::encoding::encoded_len_varint(len as u64);
        (&b[..len], prefix + len)
    }

    /// Makes the block at `off` a hole.
    fn free(&mut self, off: u64) {
        let (_, need) = self.get(off);
        self.holes.entry(need as u32).or_default().push(off);
        self.hole_bytes += need;
        self.hole_count += 1;
    }

    /// Bytes held: the blocks, the holes and the hole lists.
    fn bytes(&self) -> usize {
        self.used + self.hole_count * 8 + self.holes.len() * 48
    }

    fn wants_compaction(&self) -> bool {
        self.hole_bytes > COMPACT_MIN && self.hole_bytes * 2 > self.used
    }
}

/// Page and offset within it of an arena offset.
fn split(off: u64) -> (usize, usize) {
    ((off >> PAGE_BITS) as usize, (off as usize) & (PAGE - 1))
}

/// An interned attribute set (`KvBlocksStored` fields 3–12, encoded) and how many entries use it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Attrs {
    pub(crate) bytes: Box<[u8]>,
    pub(crate) refs: u64,
}

/// Fixed per-entry cost used by [`Table::bytes`]: a map slot and its control byte, at the
/// map's load factor (its capacity is 7/8 of its buckets).
const ENTRY_OVERHEAD: usize = (std::mem::size_of::<(Key, Slot)>() + 1) * 8 / 7;

/// The table of one ring.
#[derive(Debug, Default)]
pub struct Table {
    blocks: FastMap<Key, Slot>,
    /// The blocks' bytes.
    arena: Arena,
    pub(crate) attrs: Vec<Attrs>,
    attr_ids: FastMap<Box<[u8]>, u32>,
    free_attrs: Vec<u32>,
    /// Σ attribute bytes (with their map entry).
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

    /// Bytes the table holds: map slots (with the map's overhead), the block arena, attribute
    /// sets.
    pub fn bytes(&self) -> usize {
        self.blocks.capacity() * ENTRY_OVERHEAD + self.arena.bytes() + self.heap_bytes
    }

    /// Every held block, in the map's order.
    pub(crate) fn entries(&self) -> impl ExactSizeIterator<Item = (Key, Entry<'_>)> + '_ {
        self.blocks.iter().map(|(k, s)| {
            let e = Entry::new(
                s.parent(),
                self.arena.get(s.off()).0,
                s.attrs,
                s.copies(),
                s.rank,
            );
            (*k, e)
        })
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
        self.arena = Arena::default();
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
    pub(crate) fn insert(&mut self, key: Key, e: Entry<'_>) -> bool {
        if self.blocks.len() >= self.max_blocks {
            return false;
        }
        let off = self.arena.put(e.block);
        self.count_in(e.attrs, e.rank);
        let slot = Slot::new(e.parent, off, e.attrs, e.copies, e.rank);
        if let Some(old) = self.blocks.insert(key, slot) {
            self.drop_slot(&old);
        }
        true
    }

    /// A new block uses attribute set `attrs` and counts for `rank`.
    fn count_in(&mut self, attrs: u32, rank: u16) {
        self.attrs[attrs as usize].refs += 1;
        let r = rank as usize;
        if self.per_rank.len() <= r {
            self.per_rank.resize(r + 1, 0);
        }
        self.per_rank[r] += 1;
    }

    /// What a block no longer held gives back (its bytes, attribute set and rank count).
    fn drop_slot(&mut self, s: &Slot) {
        self.arena.free(s.off());
        if let Some(n) = self.per_rank.get_mut(s.rank as usize) {
            *n = n.saturating_sub(1);
        }
        self.release_attrs(s.attrs);
    }

    fn store(&mut self, ev: &dyn StoredEvent) {
        let class = class_of(ev.tier());
        let group = group_of(ev.group());
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        ev.write_attrs(&mut scratch);
        let attrs = self.intern(&scratch);
        let mut lost = false;
        for i in 0..ev.blocks() {
            let hash = ev.hash(i);
            let full = self.blocks.len() >= self.max_blocks;
            // one lookup per block: the entry is either another copy or a new block
            match self.blocks.entry(Key::new(hash, class, group)) {
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    let e = o.get_mut();
                    e.set_copies(e.copies() + 1);
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
                    let off = self.arena.put(&scratch);
                    v.insert(Slot::new(parent, off, attrs, 1, self.rank));
                    self.count_in(attrs, self.rank);
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

    /// Drops one copy of each hash in `class` and `group`.
    pub(crate) fn remove(&mut self, hashes: &[i64], class: u8, group: u16) {
        for &h in hashes {
            let key = Key::new(h, class, group);
            let Some(e) = self.blocks.get_mut(&key) else {
                continue;
            };
            if e.copies() > 1 {
                e.set_copies(e.copies() - 1);
                continue;
            }
            let e = self.blocks.remove(&key).expect("present");
            self.drop_slot(&e);
        }
        if self.arena.wants_compaction() {
            self.compact();
        }
    }

    /// Copies every held block into a new arena without holes.
    fn compact(&mut self) {
        let old = std::mem::take(&mut self.arena);
        for s in self.blocks.values_mut() {
            let off = self.arena.put(old.get(s.off()).0);
            s.set_off(off);
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
    fn removed(&mut self, hashes: &[i64], tier: Option<i32>, group: Option<u32>) {
        self.t.remove(hashes, class_of(tier), group_of(group));
    }
    fn cleared(&mut self) {
        self.t.clear(self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A store as a test builds it.
    #[derive(Clone, Debug)]
    struct Ev {
        parent: Option<i64>,
        tier: Option<i32>,
        group: Option<u32>,
        hashes: Vec<i64>,
        blocks: Vec<Vec<u8>>,
        attrs: Vec<u8>,
    }

    impl StoredEvent for Ev {
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
            out.extend_from_slice(&self.blocks[i]);
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store(u16, Ev),
        Remove(Vec<i64>, Option<i32>, Option<u32>),
        Clear,
    }

    /// What the reference keeps of a block: parent, bytes, attribute bytes, copies, rank.
    type RefBlock = (Option<i64>, Vec<u8>, Vec<u8>, u8, u16);

    /// The reference: a plain map with the table's rules, written out directly.
    #[derive(Default)]
    struct Reference {
        blocks: HashMap<(i64, u8, u16), RefBlock>,
        max: usize,
        unknown: u64,
    }

    impl Reference {
        fn apply(&mut self, op: &Op) {
            match op {
                Op::Store(rank, ev) => {
                    let (class, group) = (class_of(ev.tier), group_of(ev.group));
                    let mut lost = false;
                    for (i, &h) in ev.hashes.iter().enumerate() {
                        let full = self.blocks.len() >= self.max;
                        match self.blocks.get_mut(&(h, class, group)) {
                            Some(b) => b.3 = (b.3 + 1).min(COPIES_CAP),
                            None if full => lost = true,
                            None => {
                                let parent = if i == 0 {
                                    ev.parent
                                } else {
                                    Some(ev.hashes[i - 1])
                                };
                                let b = (parent, ev.blocks[i].clone(), ev.attrs.clone(), 1, *rank);
                                self.blocks.insert((h, class, group), b);
                            }
                        }
                    }
                    if lost {
                        self.unknown += 1;
                    }
                }
                Op::Remove(hashes, tier, group) => {
                    let key = |h: i64| (h, class_of(*tier), group_of(*group));
                    for h in hashes {
                        if let Some(b) = self.blocks.get_mut(&key(*h)) {
                            if b.3 > 1 {
                                b.3 -= 1;
                            } else {
                                self.blocks.remove(&key(*h));
                            }
                        }
                    }
                }
                Op::Clear => {
                    self.blocks.clear();
                    self.unknown = 0;
                }
            }
        }
    }

    fn apply(t: &mut Table, op: &Op, seq: u64) {
        let rank = match op {
            Op::Store(r, _) => *r as u32,
            _ => 0,
        };
        t.apply_with(rank, seq, seq, &mut |v| match op {
            Op::Store(_, ev) => v.stored(ev),
            Op::Remove(h, tier, group) => v.removed(h, *tier, *group),
            Op::Clear => v.cleared(),
        });
    }

    /// The table's content in the reference's form.
    fn content(t: &Table) -> HashMap<(i64, u8, u16), RefBlock> {
        t.entries()
            .map(|(k, e)| {
                let attrs = t.attrs[e.attrs as usize].bytes.to_vec();
                (
                    (k.hash(), k.class(), k.group()),
                    (e.parent, e.block.to_vec(), attrs, e.copies, e.rank),
                )
            })
            .collect()
    }

    fn tier() -> impl Strategy<Value = Option<i32>> {
        prop_oneof![Just(None), Just(Some(1)), Just(Some(2)), Just(Some(3))]
    }

    /// Unset and 0 are the same group; a hybrid model's second group.
    fn group() -> impl Strategy<Value = Option<u32>> {
        prop_oneof![Just(None), Just(Some(0)), Just(Some(1))]
    }

    fn op() -> impl Strategy<Value = Op> {
        // few hashes, so that stores hit held blocks and removals find them
        let hashes = proptest::collection::vec(0i64..48, 1..12);
        let store = (
            0u16..3,
            proptest::option::of(0i64..48),
            tier(),
            group(),
            hashes.clone(),
            // lengths vary, so that holes of many sizes are left and the arena compacts
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..90), 12),
            prop_oneof![
                Just(vec![]),
                Just(vec![0x18, 1]),
                Just(vec![0x22, 2, b'a', b'b'])
            ],
        )
            .prop_map(|(rank, parent, tier, group, hashes, mut blocks, attrs)| {
                blocks.truncate(hashes.len());
                Op::Store(
                    rank,
                    Ev {
                        parent,
                        tier,
                        group,
                        hashes,
                        blocks,
                        attrs,
                    },
                )
            });
        prop_oneof![
            6 => store,
            5 => (hashes, tier(), group()).prop_map(|(h, t, g)| Op::Remove(h, t, g)),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Random store / remove / clear sequences leave the table holding exactly what a plain
        /// map with the same rules holds (blocks, parents, bytes, attribute sets, copies, ranks,
        /// per-rank counts, completeness), and its image loads back into the same table.
        #[test]
        fn the_table_equals_a_reference_map(
            ops in proptest::collection::vec(op(), 1..160),
            max in prop_oneof![Just(usize::MAX), 10usize..40],
        ) {
            let mut t = Table::new(max, 1);
            let mut r = Reference { max, ..Default::default() };
            for (i, op) in ops.iter().enumerate() {
                apply(&mut t, op, i as u64 + 1);
                r.apply(op);
                prop_assert_eq!(t.len(), r.blocks.len());
            }
            prop_assert_eq!(content(&t), r.blocks.clone());
            prop_assert_eq!(t.unknown(), r.unknown);
            let mut per_rank = vec![0u64; t.per_rank().len()];
            for b in r.blocks.values() {
                per_rank[b.4 as usize] += 1;
            }
            prop_assert_eq!(t.per_rank(), &per_rank[..]);
            let used = t.attrs.iter().filter(|a| a.refs > 0).count();
            let distinct: std::collections::HashSet<_> = r.blocks.values().map(|b| &b.2).collect();
            prop_assert_eq!(used, distinct.len(), "attribute sets are dropped with their last block");
            let mut img = Vec::new();
            t.image(&mut img);
            let back = super::super::image::Image::parse(&img).expect("valid").to_table(max);
            prop_assert_eq!(content(&back), r.blocks);
        }
    }

    #[test]
    fn holes_of_one_length_are_reused_and_drifting_lengths_compact() {
        let mut a = Arena::default();
        let offs: Vec<u64> = (0..1000u32).map(|i| a.put(&i.to_le_bytes())).collect();
        let len = a.used;
        for &o in &offs[..500] {
            a.free(o);
        }
        for i in 0..500u32 {
            a.put(&(i + 7).to_le_bytes());
        }
        assert_eq!(a.used, len, "same-length blocks fill the holes");
        assert_eq!((a.hole_bytes, a.hole_count), (0, 0));
        let big = vec![3u8; 3 * PAGE];
        let off = a.put(&big);
        assert_eq!(
            a.get(off).0,
            &big[..],
            "a block longer than a page has a page of its own"
        );
        let next = a.put(b"next");
        assert_eq!(a.get(next).0, b"next");
        let mut t = Table::new(usize::MAX, 1);
        let store = |t: &mut Table, h: i64, n: usize| {
            let ev = Ev {
                parent: None,
                tier: None,
                group: None,
                hashes: vec![h],
                blocks: vec![vec![7; n]],
                attrs: vec![],
            };
            apply(t, &Op::Store(0, ev), h as u64);
        };
        for h in 0..2000 {
            store(&mut t, h, 1000);
        }
        let full = t.arena.used;
        apply(&mut t, &Op::Remove((0..1500).collect(), None, None), 3000);
        assert!(
            t.arena.used < full / 2,
            "compacted: {} of {full}",
            t.arena.used
        );
        for h in 1500..2000 {
            assert_eq!(
                t.arena.get(t.blocks[&Key::new(h, 0, 0)].off()).0,
                &[7; 1000][..]
            );
        }
    }
}
