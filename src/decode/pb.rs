//! Protobuf wire helpers: varint sizes, a slice writer, and the field tags of the SMG messages.

/// Encoded size of a varint.
#[inline(always)]
pub(crate) fn vlen(v: u64) -> usize {
    VLEN_BY_LZ[(v | 1).leading_zeros() as usize] as usize
}

/// Varint size by the value's leading-zero count (0..=63).
static VLEN_BY_LZ: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut lz = 0;
    while lz < 64 {
        t[lz] = (64 - lz).div_ceil(7) as u8;
        lz += 1;
    }
    t
};

/// Size of a length-delimited field (tag byte + length prefix + body).
#[inline(always)]
pub(crate) fn ld(body: usize) -> usize {
    1 + vlen(body as u64) + body
}

/// Size of an optional varint field (tag byte + value); 0 when absent. Pairs with
/// [`W::opt_varint`].
#[inline(always)]
pub(crate) fn opt_varint_len(v: Option<u64>) -> usize {
    v.map_or(0, |v| 1 + vlen(v))
}

/// The varint of an `int32` / enum value (negative values take 10 bytes, as in prost).
#[inline(always)]
pub(crate) fn int32(v: i32) -> u64 {
    v as i64 as u64
}

/// Writes into a caller-provided slice. Indexing panics if the slice is too short, which the
/// callers rule out beforehand.
pub(crate) struct W<'a> {
    pub(crate) buf: &'a mut [u8],
    pub(crate) pos: usize,
}

impl W<'_> {
    #[inline(always)]
    pub(crate) fn u8(&mut self, b: u8) {
        self.buf[self.pos] = b;
        self.pos += 1;
    }
    #[inline(always)]
    pub(crate) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.u8((v as u8) | 0x80);
            v >>= 7;
        }
        self.u8(v as u8);
    }
    #[inline(always)]
    pub(crate) fn bytes(&mut self, s: &[u8]) {
        let d = &mut self.buf[self.pos..self.pos + s.len()];
        if s.len() <= 16 {
            // short strings (medium, kind, …): avoid a memmove call
            for (d, s) in d.iter_mut().zip(s) {
                *d = *s;
            }
        } else {
            d.copy_from_slice(s);
        }
        self.pos += s.len();
    }
    /// Tag + varint.
    #[inline(always)]
    pub(crate) fn field_varint(&mut self, tag: u8, v: u64) {
        self.u8(tag);
        self.varint(v);
    }
    /// Tag + varint when present (see [`opt_varint_len`]).
    #[inline(always)]
    pub(crate) fn opt_varint(&mut self, tag: u8, v: Option<u64>) {
        if let Some(v) = v {
            self.field_varint(tag, v);
        }
    }
    /// Tag + length + bytes.
    #[inline(always)]
    pub(crate) fn ld_bytes(&mut self, tag: u8, s: &[u8]) {
        self.u8(tag);
        self.varint(s.len() as u64);
        self.bytes(s);
    }
}

/// Field tags (`field_number << 3 | wire_type`, one byte: every number used is ≤ 15) of the
/// `smg.grpc.common` messages the decoder writes, named `MESSAGE_FIELD`. The numbers are those
/// of `proto/smg/grpc/common.proto`; the test below checks each against the compiled descriptor.
pub(crate) mod tag {
    /// Wire type 0: varint (ints, enums).
    const VARINT: u8 = 0;
    /// Wire type 1: 64-bit (double).
    const I64: u8 = 1;
    /// Wire type 2: length-delimited (strings, bytes, messages, packed repeated scalars).
    const LEN: u8 = 2;

    const fn t(field: u8, wire: u8) -> u8 {
        assert!(field >= 1 && field <= 15, "one-byte tags only");
        field << 3 | wire
    }

    // KvEventBatch
    pub(crate) const KV_EVENT_BATCH_SEQUENCE_NUMBER: u8 = t(1, VARINT);
    pub(crate) const KV_EVENT_BATCH_TIMESTAMP: u8 = t(2, I64);
    pub(crate) const KV_EVENT_BATCH_EVENTS: u8 = t(3, LEN);
    pub(crate) const KV_EVENT_BATCH_DP_RANK: u8 = t(4, VARINT);

    // KvCacheEvent
    pub(crate) const KV_CACHE_EVENT_EVENT_ID: u8 = t(1, VARINT);
    pub(crate) const KV_CACHE_EVENT_STORED: u8 = t(2, LEN);
    pub(crate) const KV_CACHE_EVENT_REMOVED: u8 = t(3, LEN);
    pub(crate) const KV_CACHE_EVENT_CLEARED: u8 = t(4, LEN);

    // KvBlocksStored
    pub(crate) const KV_BLOCKS_STORED_BLOCKS: u8 = t(1, LEN);
    pub(crate) const KV_BLOCKS_STORED_PARENT_BLOCK_HASH: u8 = t(2, VARINT);
    pub(crate) const KV_BLOCKS_STORED_TIER: u8 = t(3, VARINT);
    pub(crate) const KV_BLOCKS_STORED_MEDIUM: u8 = t(4, LEN);
    pub(crate) const KV_BLOCKS_STORED_GROUP_IDX: u8 = t(5, VARINT);
    pub(crate) const KV_BLOCKS_STORED_KV_CACHE_SPEC_KIND: u8 = t(6, LEN);
    pub(crate) const KV_BLOCKS_STORED_KV_CACHE_SPEC_SLIDING_WINDOW: u8 = t(7, VARINT);
    pub(crate) const KV_BLOCKS_STORED_LOCALITY: u8 = t(8, VARINT);
    pub(crate) const KV_BLOCKS_STORED_OWNERSHIP: u8 = t(9, LEN);
    pub(crate) const KV_BLOCKS_STORED_SESSION_ID: u8 = t(10, LEN);
    pub(crate) const KV_BLOCKS_STORED_LORA_NAME: u8 = t(11, LEN);
    pub(crate) const KV_BLOCKS_STORED_CACHE_SALT: u8 = t(12, LEN);

    // KvBlock
    pub(crate) const KV_BLOCK_BLOCK_HASH: u8 = t(1, VARINT);
    pub(crate) const KV_BLOCK_TOKEN_IDS: u8 = t(2, LEN);
    pub(crate) const KV_BLOCK_BLOCK_SIZE: u8 = t(3, VARINT);
    pub(crate) const KV_BLOCK_LORA_ID: u8 = t(4, VARINT);
    pub(crate) const KV_BLOCK_CACHE_LEVEL: u8 = t(5, VARINT);
    pub(crate) const KV_BLOCK_EXTRA_KEYS: u8 = t(6, LEN);

    // KvBlockExtraKey (oneof `key`)
    pub(crate) const KV_BLOCK_EXTRA_KEY_TEXT: u8 = t(1, LEN);
    pub(crate) const KV_BLOCK_EXTRA_KEY_BLOB: u8 = t(2, LEN);
    pub(crate) const KV_BLOCK_EXTRA_KEY_NUMBER: u8 = t(3, VARINT);
    pub(crate) const KV_BLOCK_EXTRA_KEY_MULTIMODAL: u8 = t(4, LEN);

    // KvMultimodalKey
    pub(crate) const KV_MULTIMODAL_KEY_IDENTIFIER: u8 = t(1, LEN);
    pub(crate) const KV_MULTIMODAL_KEY_OFFSET: u8 = t(2, VARINT);

    // KvBlocksRemoved
    pub(crate) const KV_BLOCKS_REMOVED_BLOCK_HASHES: u8 = t(1, LEN);
    pub(crate) const KV_BLOCKS_REMOVED_CACHE_LEVEL: u8 = t(2, VARINT);
    pub(crate) const KV_BLOCKS_REMOVED_TIER: u8 = t(3, VARINT);
    pub(crate) const KV_BLOCKS_REMOVED_MEDIUM: u8 = t(4, LEN);
    pub(crate) const KV_BLOCKS_REMOVED_GROUP_IDX: u8 = t(5, VARINT);
    pub(crate) const KV_BLOCKS_REMOVED_LOCALITY: u8 = t(6, VARINT);
    pub(crate) const KV_BLOCKS_REMOVED_OWNERSHIP: u8 = t(7, LEN);

    // KvCacheCleared
    pub(crate) const KV_CACHE_CLEARED_OWNERSHIP: u8 = t(1, LEN);

    /// Every tag above with its message and field name, for the descriptor check.
    #[cfg(test)]
    #[rustfmt::skip]
    pub(super) const ALL: &[(u8, &str, &str)] = &[
        (KV_EVENT_BATCH_SEQUENCE_NUMBER, "KvEventBatch", "sequence_number"),
        (KV_EVENT_BATCH_TIMESTAMP, "KvEventBatch", "timestamp"),
        (KV_EVENT_BATCH_EVENTS, "KvEventBatch", "events"),
        (KV_EVENT_BATCH_DP_RANK, "KvEventBatch", "dp_rank"),
        (KV_CACHE_EVENT_EVENT_ID, "KvCacheEvent", "event_id"),
        (KV_CACHE_EVENT_STORED, "KvCacheEvent", "stored"),
        (KV_CACHE_EVENT_REMOVED, "KvCacheEvent", "removed"),
        (KV_CACHE_EVENT_CLEARED, "KvCacheEvent", "cleared"),
        (KV_BLOCKS_STORED_BLOCKS, "KvBlocksStored", "blocks"),
        (KV_BLOCKS_STORED_PARENT_BLOCK_HASH, "KvBlocksStored", "parent_block_hash"),
        (KV_BLOCKS_STORED_TIER, "KvBlocksStored", "tier"),
        (KV_BLOCKS_STORED_MEDIUM, "KvBlocksStored", "medium"),
        (KV_BLOCKS_STORED_GROUP_IDX, "KvBlocksStored", "group_idx"),
        (KV_BLOCKS_STORED_KV_CACHE_SPEC_KIND, "KvBlocksStored", "kv_cache_spec_kind"),
        (
            KV_BLOCKS_STORED_KV_CACHE_SPEC_SLIDING_WINDOW,
            "KvBlocksStored",
            "kv_cache_spec_sliding_window",
        ),
        (KV_BLOCKS_STORED_LOCALITY, "KvBlocksStored", "locality"),
        (KV_BLOCKS_STORED_OWNERSHIP, "KvBlocksStored", "ownership"),
        (KV_BLOCKS_STORED_SESSION_ID, "KvBlocksStored", "session_id"),
        (KV_BLOCKS_STORED_LORA_NAME, "KvBlocksStored", "lora_name"),
        (KV_BLOCKS_STORED_CACHE_SALT, "KvBlocksStored", "cache_salt"),
        (KV_BLOCK_BLOCK_HASH, "KvBlock", "block_hash"),
        (KV_BLOCK_TOKEN_IDS, "KvBlock", "token_ids"),
        (KV_BLOCK_BLOCK_SIZE, "KvBlock", "block_size"),
        (KV_BLOCK_LORA_ID, "KvBlock", "lora_id"),
        (KV_BLOCK_CACHE_LEVEL, "KvBlock", "cache_level"),
        (KV_BLOCK_EXTRA_KEYS, "KvBlock", "extra_keys"),
        (KV_BLOCK_EXTRA_KEY_TEXT, "KvBlockExtraKey", "text"),
        (KV_BLOCK_EXTRA_KEY_BLOB, "KvBlockExtraKey", "blob"),
        (KV_BLOCK_EXTRA_KEY_NUMBER, "KvBlockExtraKey", "number"),
        (KV_BLOCK_EXTRA_KEY_MULTIMODAL, "KvBlockExtraKey", "multimodal"),
        (KV_MULTIMODAL_KEY_IDENTIFIER, "KvMultimodalKey", "identifier"),
        (KV_MULTIMODAL_KEY_OFFSET, "KvMultimodalKey", "offset"),
        (KV_BLOCKS_REMOVED_BLOCK_HASHES, "KvBlocksRemoved", "block_hashes"),
        (KV_BLOCKS_REMOVED_CACHE_LEVEL, "KvBlocksRemoved", "cache_level"),
        (KV_BLOCKS_REMOVED_TIER, "KvBlocksRemoved", "tier"),
        (KV_BLOCKS_REMOVED_MEDIUM, "KvBlocksRemoved", "medium"),
        (KV_BLOCKS_REMOVED_GROUP_IDX, "KvBlocksRemoved", "group_idx"),
        (KV_BLOCKS_REMOVED_LOCALITY, "KvBlocksRemoved", "locality"),
        (KV_BLOCKS_REMOVED_OWNERSHIP, "KvBlocksRemoved", "ownership"),
        (KV_CACHE_CLEARED_OWNERSHIP, "KvCacheCleared", "ownership"),
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_reflect::{DescriptorPool, Kind};

    /// Each named tag has the field number and wire type the compiled `proto/` gives its field.
    #[test]
    fn tags_match_the_proto() {
        let pool = DescriptorPool::decode(crate::proto::FILE_DESCRIPTOR_SET).unwrap();
        for &(t, msg, field) in tag::ALL {
            let m = pool
                .get_message_by_name(&format!("smg.grpc.common.{msg}"))
                .unwrap_or_else(|| panic!("no message {msg}"));
            let f = m
                .get_field_by_name(field)
                .unwrap_or_else(|| panic!("no field {msg}.{field}"));
            let wire = if f.is_list() || f.is_map() {
                2 // packed repeated scalars and repeated messages
            } else {
                match f.kind() {
                    Kind::Double | Kind::Fixed64 | Kind::Sfixed64 => 1,
                    Kind::String | Kind::Bytes | Kind::Message(_) => 2,
                    Kind::Float | Kind::Fixed32 | Kind::Sfixed32 => 5,
                    _ => 0,
                }
            };
            assert_eq!(t as u32, f.number() << 3 | wire, "{msg}.{field}");
        }
    }

    #[test]
    fn varint_sizes() {
        for (v, n) in [
            (0u64, 1),
            (127, 1),
            (128, 2),
            (16383, 2),
            (16384, 3),
            (u64::MAX, 10),
        ] {
            assert_eq!(vlen(v), n, "{v}");
            let mut buf = [0u8; 10];
            let mut w = W {
                buf: &mut buf,
                pos: 0,
            };
            w.varint(v);
            assert_eq!(w.pos, n, "{v}");
        }
        assert_eq!(opt_varint_len(Some(int32(-1))), 11);
        assert_eq!(opt_varint_len(None), 0);
    }
}
