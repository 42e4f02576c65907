//! Engine msgpack encoders for the simulated publisher, one per representative release.

use rmp::encode as enc;

/// One engine event, before encoding.
#[derive(Clone, Debug, PartialEq)]
pub enum SimEvent {
    /// `BlockStored`.
    Stored {
        /// Block hashes (64-bit patterns).
        hashes: Vec<u64>,
        /// Parent hash.
        parent: Option<u64>,
        /// All tokens of the event.
        tokens: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Storage medium.
        medium: Option<String>,
    },
    /// `BlockRemoved`.
    Removed {
        /// Hashes.
        hashes: Vec<u64>,
        /// Storage medium.
        medium: Option<String>,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// Which engine release's msgpack layout to emit (docs/engine-wire.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// vLLM 0.9.0: 2-element batch, 6-element stores, signed hashes.
    Vllm090,
    /// vLLM 0.10.2: `medium` added, u64 hashes.
    Vllm0102,
    /// vLLM 0.22: 12-element array stores.
    Vllm022,
    /// vLLM 0.22 with raw 32-byte digest hashes (`c4 20 …`).
    Vllm022Bin,
    /// vLLM 0.33: map events, map16 store header.
    Vllm033,
    /// SGLang 0.5.19: array events, signed hashes.
    Sglang0519,
    /// SGLang 0.5.23: map events without `medium` when nil.
    Sglang0523,
    /// TokenSpeed: 4-field stores, u64 hashes.
    TokenSpeed,
}

impl Layout {
    /// Every layout, for round-robin workloads.
    pub const ALL: [Layout; 8] = [
        Layout::Vllm090,
        Layout::Vllm0102,
        Layout::Vllm022,
        Layout::Vllm022Bin,
        Layout::Vllm033,
        Layout::Sglang0519,
        Layout::Sglang0523,
        Layout::TokenSpeed,
    ];

    fn signed_hashes(self) -> bool {
        matches!(
            self,
            Layout::Vllm090 | Layout::Sglang0519 | Layout::Sglang0523
        )
    }
}

fn hash(out: &mut Vec<u8>, layout: Layout, h: u64) {
    if layout == Layout::Vllm022Bin {
        // A 32-byte digest whose last 8 bytes are the 64-bit key.
        let mut d = [0xABu8; 32];
        d[24..].copy_from_slice(&h.to_be_bytes());
        enc::write_bin(out, &d).expect("vec write");
    } else if layout.signed_hashes() {
        enc::write_sint(out, h as i64).expect("vec write");
    } else {
        enc::write_uint(out, h).expect("vec write");
    }
}

fn hashes(out: &mut Vec<u8>, layout: Layout, hs: &[u64]) {
    enc::write_array_len(out, hs.len() as u32).expect("vec write");
    for &h in hs {
        hash(out, layout, h);
    }
}

fn opt_str(out: &mut Vec<u8>, s: &Option<String>) {
    match s {
        Some(s) => enc::write_str(out, s).expect("vec write"),
        None => enc::write_nil(out).expect("vec write"),
    }
}

fn key(out: &mut Vec<u8>, k: &str) {
    enc::write_str(out, k).expect("vec write");
}

fn tokens(out: &mut Vec<u8>, t: &[u32]) {
    enc::write_array_len(out, t.len() as u32).expect("vec write");
    for &x in t {
        enc::write_uint(out, x as u64).expect("vec write");
    }
}

fn parent(out: &mut Vec<u8>, layout: Layout, p: &Option<u64>) {
    match p {
        Some(p) => hash(out, layout, *p),
        None => enc::write_nil(out).expect("vec write"),
    }
}

/// The keys a map-form `BlockStored` always carries (required even when nil), `type` first.
fn map_store_required(
    o: &mut Vec<u8>,
    layout: Layout,
    hs: &[u64],
    p: &Option<u64>,
    t: &[u32],
    bs: u32,
) {
    key(o, "type");
    key(o, "BlockStored");
    key(o, "block_hashes");
    hashes(o, layout, hs);
    key(o, "parent_block_hash");
    parent(o, layout, p);
    key(o, "token_ids");
    tokens(o, t);
    key(o, "block_size");
    enc::write_uint(o, bs as u64).expect("vec write");
    key(o, "lora_id");
    enc::write_nil(o).expect("vec write");
}

/// Encodes one batch `[ts, events, rank]` (or `[ts, events]` for vLLM 0.9.0) in `layout`.
pub fn encode_batch(layout: Layout, ts: f64, events: &[SimEvent], rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let o = &mut out;
    enc::write_array_len(o, if layout == Layout::Vllm090 { 2 } else { 3 }).expect("vec write");
    enc::write_f64(o, ts).expect("vec write");
    enc::write_array_len(o, events.len() as u32).expect("vec write");
    for e in events {
        event(o, layout, e);
    }
    if layout != Layout::Vllm090 {
        enc::write_uint(o, rank as u64).expect("vec write");
    }
    out
}

fn event(o: &mut Vec<u8>, layout: Layout, e: &SimEvent) {
    use Layout::*;
    match (layout, e) {
        (Vllm033 | Sglang0523, SimEvent::Cleared) => {
            enc::write_map_len(o, 1).expect("vec write");
            key(o, "type");
            key(o, "AllBlocksCleared");
        }
        (_, SimEvent::Cleared) => {
            enc::write_array_len(o, 1).expect("vec write");
            key(o, "AllBlocksCleared");
        }
        (
            Vllm033,
            SimEvent::Stored {
                hashes: hs,
                parent: p,
                tokens: t,
                block_size,
                medium,
            },
        ) => {
            // vLLM 0.33 sizes the header for all 16 possible keys: map16 (here 9 entries).
            o.extend_from_slice(&[0xde, 0x00, 0x09]);
            map_store_required(o, layout, hs, p, t, *block_size);
            key(o, "medium");
            opt_str(o, medium);
            key(o, "lora_name");
            enc::write_nil(o).expect("vec write");
            key(o, "kv_cache_spec_kind");
            key(o, "full_attention");
        }
        (
            Sglang0523,
            SimEvent::Stored {
                hashes: hs,
                parent: p,
                tokens: t,
                block_size,
                medium,
            },
        ) => {
            enc::write_map_len(o, if medium.is_some() { 7 } else { 6 }).expect("vec write");
            map_store_required(o, layout, hs, p, t, *block_size);
            if medium.is_some() {
                key(o, "medium");
                opt_str(o, medium);
            }
        }
        (Vllm033 | Sglang0523, SimEvent::Removed { hashes: hs, medium }) => {
            enc::write_map_len(o, 3).expect("vec write");
            key(o, "type");
            key(o, "BlockRemoved");
            key(o, "block_hashes");
            hashes(o, layout, hs);
            key(o, "medium");
            opt_str(o, medium);
        }
        (
            TokenSpeed,
            SimEvent::Stored {
                hashes: hs,
                parent: p,
                tokens: t,
                block_size,
                ..
            },
        ) => {
            enc::write_array_len(o, 5).expect("vec write");
            key(o, "BlockStored");
            hashes(o, layout, hs);
            parent(o, layout, p);
            tokens(o, t);
            enc::write_uint(o, *block_size as u64).expect("vec write");
        }
        (TokenSpeed | Vllm090, SimEvent::Removed { hashes: hs, .. }) => {
            enc::write_array_len(o, 2).expect("vec write");
            key(o, "BlockRemoved");
            hashes(o, layout, hs);
        }
        (_, SimEvent::Removed { hashes: hs, medium }) => {
            let v022 = matches!(layout, Vllm022 | Vllm022Bin);
            enc::write_array_len(o, if v022 { 4 } else { 3 }).expect("vec write");
            key(o, "BlockRemoved");
            hashes(o, layout, hs);
            opt_str(o, medium);
            if v022 {
                enc::write_uint(o, 0).expect("vec write");
            }
        }
        (
            _,
            SimEvent::Stored {
                hashes: hs,
                parent: p,
                tokens: t,
                block_size,
                medium,
            },
        ) => {
            let len = match layout {
                Vllm090 => 6,
                Vllm0102 | Sglang0519 => 7,
                _ => 12,
            };
            enc::write_array_len(o, len).expect("vec write");
            key(o, "BlockStored");
            hashes(o, layout, hs);
            parent(o, layout, p);
            tokens(o, t);
            enc::write_uint(o, *block_size as u64).expect("vec write");
            enc::write_nil(o).expect("vec write"); // lora_id
            if len >= 7 {
                opt_str(o, medium);
            }
            if len == 12 {
                enc::write_nil(o).expect("vec write"); // lora_name
                enc::write_array_len(o, hs.len() as u32).expect("vec write"); // extra_keys: one nil per hash
                for _ in hs {
                    enc::write_nil(o).expect("vec write");
                }
                enc::write_uint(o, 0).expect("vec write"); // group_idx
                key(o, "full_attention");
                enc::write_nil(o).expect("vec write"); // sliding window
            }
        }
    }
}
