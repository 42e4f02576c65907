//! Snapshot chunks (docs/smg-api.md §3.5, §6.5) from a table image taken at the cut N.
//!
//! * chunk 0 begins with a `cleared` (no ownership), so the gateway drops what it held;
//! * stores go **parents first** (a block's parent, in any class, is sent before it); chains are
//!   regrouped into one `BlockStored` per run of blocks sharing a store's attribute set, each
//!   with its original `parent_block_hash` and fields; every further physical copy of a block is
//!   one more single-block store, after all first copies;
//! * every event carries `event_id` 0 (the field is left out);
//! * the `count` chunks are numbered N − count + 1 … N, each with `snapshot { index, count,
//!   blocks, unknown_before }`; live batches continue at N + 1;
//! * every chunk stays under [`CHUNK_MAX`] bytes (gRPC's 4 MiB default is the hard limit).
use bytes::Bytes;
use prost::encoding::{encode_varint, encoded_len_varint};

use super::image::{Image, ImageBlock};
use super::table::{FastMap, Table};
use crate::ring::GRPC_PREFIX_LEN;

impl Table {
    /// The table's snapshot at its cut, in chunks of at most `chunk_bytes` (`None`: the cut is
    /// below the chunk count). What a subscriber gets; here without the lock and metrics.
    pub fn chunks(&self, chunk_bytes: usize) -> Option<Chunks> {
        let mut img = Vec::new();
        self.image(&mut img);
        let parsed = Image::parse(&img).expect("an image written in this process");
        build(&parsed, crate::clock::unix_seconds(), None, chunk_bytes)
    }
}

/// Default most bytes in one chunk (the events of a chunk stop growing before they pass it).
pub const CHUNK_MAX: usize = 1 << 20;
/// Smallest chunk limit accepted: one block with its store's fields always fits.
pub const CHUNK_MIN: usize = 4096;

/// Per-chunk bytes outside `events`: sequence number, timestamp, dp_rank and the snapshot
/// message, at their largest.
const CHUNK_OVERHEAD: usize = 11 + 9 + 11 + 2 + 6 + 6 + 11 + 11;

/// A built snapshot: encoded `KvEventBatch`es numbered `first_seq ..= cut`.
#[derive(Debug, Clone)]
pub struct Chunks {
    /// The encoded chunks, in order.
    pub chunks: Vec<Bytes>,
    /// The same chunks as uncompressed gRPC messages (5-byte prefix, then the chunk), sharing
    /// their buffers: what the gRPC edge sends, without a copy per subscriber.
    pub framed: Vec<Bytes>,
    /// The cut N: the last chunk's number; live batches continue at N + 1.
    pub cut: u64,
    /// Blocks in the snapshot (copies count once).
    pub blocks: u64,
    /// `unknown_before` of every chunk (0 = complete).
    pub unknown_before: u64,
}

/// The order blocks are sent in: every block after the blocks (of any class) its parent hash
/// names, as far as the image holds them. Iterative depth-first; a cycle in bad input cannot
/// loop (only unvisited blocks are pushed).
fn parents_first(blocks: &[ImageBlock<'_>]) -> Vec<u32> {
    let n = blocks.len();
    // first index per hash, then a chain of further indexes with the same hash
    let mut first: FastMap<i64, u32> = FastMap::default();
    first.reserve(n);
    let mut next_same = vec![u32::MAX; n];
    for (i, b) in blocks.iter().enumerate() {
        if let Some(prev) = first.insert(b.hash, i as u32) {
            next_same[i] = prev;
        }
    }
    let mut state = vec![0u8; n]; // 0 new, 1 on the path, 2 sent
    let mut order = Vec::with_capacity(n);
    let mut stack: Vec<u32> = Vec::new();
    for i in 0..n as u32 {
        if state[i as usize] != 0 {
            continue;
        }
        stack.push(i);
        while let Some(&j) = stack.last() {
            let ju = j as usize;
            if state[ju] == 2 {
                stack.pop();
                continue;
            }
            state[ju] = 1;
            let mut pushed = false;
            if let Some(p) = blocks[ju].parent {
                let mut k = first.get(&p).copied().unwrap_or(u32::MAX);
                while k != u32::MAX {
                    if state[k as usize] == 0 {
                        stack.push(k);
                        pushed = true;
                        break;
                    }
                    k = next_same[k as usize];
                }
            }
            if !pushed {
                state[ju] = 2;
                order.push(j);
                stack.pop();
            }
        }
    }
    order
}

/// Accumulates events into chunks.
struct Builder<'a> {
    img: &'a Image<'a>,
    chunks: Vec<Vec<u8>>,
    cur: Vec<u8>,
    /// The open store: its blocks, parent, attribute set, and the last block's hash.
    blocks: Vec<u8>,
    parent: Option<i64>,
    attrs: u32,
    last: Option<i64>,
    max: usize,
}

impl<'a> Builder<'a> {
    fn new(img: &'a Image<'a>, max: usize) -> Self {
        let mut b = Builder {
            img,
            max,
            chunks: Vec::new(),
            cur: Vec::with_capacity(max),
            blocks: Vec::new(),
            parent: None,
            attrs: 0,
            last: None,
        };
        // `events { cleared {} }`: field 3, length 2; `cleared` is field 4, length 0.
        b.cur.extend_from_slice(&[0x1a, 0x02, 0x22, 0x00]);
        b
    }

    fn attrs_of(&self, id: u32) -> &'a [u8] {
        self.img
            .attrs
            .get(id as usize)
            .copied()
            .flatten()
            .unwrap_or(&[])
    }

    /// Encoded size of the open store as an `events` entry.
    fn open_len(&self, extra_block: usize) -> usize {
        let stored = self.blocks.len()
            + extra_block
            + self.parent.map_or(0, |p| 1 + encoded_len_varint(p as u64))
            + self.attrs_of(self.attrs).len();
        let event = 1 + encoded_len_varint(stored as u64) + stored;
        1 + encoded_len_varint(event as u64) + event
    }

    fn close_store(&mut self) {
        if self.last.is_none() {
            return;
        }
        let attrs = self.attrs_of(self.attrs);
        let stored = self.blocks.len()
            + self.parent.map_or(0, |p| 1 + encoded_len_varint(p as u64))
            + attrs.len();
        let event = 1 + encoded_len_varint(stored as u64) + stored;
        let out = &mut self.cur;
        out.push(0x1a); // KvEventBatch.events
        encode_varint(event as u64, out);
        out.push(0x12); // KvCacheEvent.stored (event_id 0: left out)
        encode_varint(stored as u64, out);
        out.extend_from_slice(&self.blocks);
        if let Some(p) = self.parent {
            out.push(0x10); // KvBlocksStored.parent_block_hash
            encode_varint(p as u64, out);
        }
        out.extend_from_slice(attrs);
        self.blocks.clear();
        self.last = None;
    }

    fn close_chunk(&mut self) {
        self.close_store();
        let full = std::mem::replace(&mut self.cur, Vec::with_capacity(self.max));
        self.chunks.push(full);
    }

    /// Adds a block: to the open store when it continues that store's chain with the same
    /// attribute set, else as a new store.
    fn block(&mut self, b: &ImageBlock<'_>) {
        let continues = self.last.is_some() && self.last == b.parent && self.attrs == b.attrs;
        if continues {
            if self.cur.len() + self.open_len(b.block.len()) + CHUNK_OVERHEAD > self.max {
                // the chain goes on in the next chunk, its parent named explicitly
                self.close_chunk();
            }
        } else {
            self.close_store();
        }
        if self.last.is_none() {
            if self.cur.len() + self.open_len_new(b) + CHUNK_OVERHEAD > self.max {
                self.close_chunk();
            }
            self.parent = b.parent;
            self.attrs = b.attrs;
        }
        self.blocks.extend_from_slice(b.block);
        self.last = Some(b.hash);
    }

    fn open_len_new(&self, b: &ImageBlock<'_>) -> usize {
        let stored = b.block.len()
            + b.parent.map_or(0, |p| 1 + encoded_len_varint(p as u64))
            + self.attrs_of(b.attrs).len();
        let event = 1 + encoded_len_varint(stored as u64) + stored;
        1 + encoded_len_varint(event as u64) + event
    }

    fn finish(mut self) -> Vec<Vec<u8>> {
        self.close_chunk();
        self.chunks
    }
}

/// The events of `img`'s chunks, each at most `max` bytes: encoded `KvCacheEvent`s as
/// `KvEventBatch.events` entries (field 3), the first one a `cleared`, then the stores parents
/// first and the further copies.
pub(crate) fn bodies(img: &Image<'_>, max: usize) -> Vec<Vec<u8>> {
    let order = parents_first(&img.blocks);
    let mut b = Builder::new(img, max.max(CHUNK_MIN));
    for &i in &order {
        b.block(&img.blocks[i as usize]);
    }
    // further physical copies: one single-block store each, after every first copy
    for &i in &order {
        let blk = &img.blocks[i as usize];
        for _ in 1..blk.copies {
            b.close_store();
            b.block(blk);
            b.close_store();
        }
    }
    b.finish()
}

/// Builds the chunks of `img` (taken at its cut N), stamped `ts`, carrying `dp_rank` when set,
/// each at most `max` bytes. `None` when N < count (the numbers N − count + 1 … N would not
/// all be ≥ 1).
pub(crate) fn build(img: &Image<'_>, ts: f64, dp_rank: Option<i32>, max: usize) -> Option<Chunks> {
    let bodies = bodies(img, max);
    let count = bodies.len() as u64;
    let cut = img.cut;
    if cut < count {
        return None;
    }
    let blocks = img.blocks.len() as u64;
    let unknown_before = img.unknown;
    let mut chunks = Vec::with_capacity(bodies.len());
    let mut framed = Vec::with_capacity(bodies.len());
    for (k, events) in bodies.into_iter().enumerate() {
        let seq = cut - count + 1 + k as u64;
        let mut snap = Vec::with_capacity(32);
        if k > 0 {
            snap.push(0x08);
            encode_varint(k as u64, &mut snap);
        }
        snap.push(0x10);
        encode_varint(count, &mut snap);
        if blocks > 0 {
            snap.push(0x18);
            encode_varint(blocks, &mut snap);
        }
        if unknown_before > 0 {
            snap.push(0x20);
            encode_varint(unknown_before, &mut snap);
        }
        // Room for the gRPC message prefix, filled in below: the edge sends the chunk framed.
        let mut out = Vec::with_capacity(GRPC_PREFIX_LEN + events.len() + CHUNK_OVERHEAD);
        out.extend_from_slice(&[0; GRPC_PREFIX_LEN]);
        out.push(0x08); // sequence_number
        encode_varint(seq, &mut out);
        if ts != 0.0 {
            out.push(0x11); // timestamp
            out.extend_from_slice(&ts.to_bits().to_le_bytes());
        }
        out.extend_from_slice(&events);
        if let Some(r) = dp_rank {
            out.push(0x20); // dp_rank (int32: negative values sign-extended)
            encode_varint(r as i64 as u64, &mut out);
        }
        out.push(0x3a); // snapshot
        encode_varint(snap.len() as u64, &mut out);
        out.extend_from_slice(&snap);
        let len = u32::try_from(out.len() - GRPC_PREFIX_LEN).expect("chunks are below 4 MiB");
        out[1..GRPC_PREFIX_LEN].copy_from_slice(&len.to_be_bytes());
        let message = Bytes::from(out);
        chunks.push(message.slice(GRPC_PREFIX_LEN..));
        framed.push(message);
    }
    Some(Chunks {
        chunks,
        framed,
        cut,
        blocks,
        unknown_before,
    })
}
