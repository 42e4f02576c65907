//! Pass 1, the msgpack side: walk the batch (array or map form) and each event (tagged array or
//! tagged map, docs/engine-wire.md §3–§6) into [`Fields`] (read by `fields.rs`), then hand each known
//! event to `measure.rs`. Batch-level problems are [`DecodeError`]s; event-level ones are
//! skipped and counted.
use super::error::{DecodeError, DecodeErrorKind as K};
use super::fields::{
    tag_of, Fields, Invalid, Tag, F_BLOCK_OFFSETS, F_BS, F_COPIES, F_EXTRA, F_GROUP, F_HASHES,
    F_KIND, F_LOCALITY, F_LOOKAHEAD, F_LORA_ID, F_LORA_NAME, F_MEDIUM, F_METADATA, F_OWNERSHIP,
    F_PARENT, F_REASON, F_SALT, F_SESSION, F_SLIDING, F_TOKENS, F_TOKEN_OFFSET, F_TYPE, F_VERSION,
};
use super::reader::{Cur, Int};
use super::{BatchPlan, Decoder};
use rmp::Marker;

/// Map keys that belong to each event type (others are read but counted as unknown keys).
const ALLOW_STORED: u32 =
    ((1 << 18) - 1) | (1 << F_VERSION) | (1 << F_TOKEN_OFFSET) | (1 << F_BLOCK_OFFSETS);
const ALLOW_REMOVED: u32 = 1 << F_TYPE
    | 1 << F_HASHES
    | 1 << F_MEDIUM
    | 1 << F_GROUP
    | 1 << F_LOCALITY
    | 1 << F_OWNERSHIP
    | 1 << F_COPIES
    | 1 << F_REASON;
const ALLOW_CLEARED: u32 = 1 << F_TYPE | 1 << F_OWNERSHIP;

fn key_id(k: &[u8]) -> Option<u32> {
    Some(match k {
        b"type" => F_TYPE,
        b"block_hashes" => F_HASHES,
        b"parent_block_hash" => F_PARENT,
        b"token_ids" => F_TOKENS,
        b"block_size" => F_BS,
        b"lora_id" => F_LORA_ID,
        b"medium" => F_MEDIUM,
        b"lora_name" => F_LORA_NAME,
        b"extra_keys" => F_EXTRA,
        b"group_idx" => F_GROUP,
        b"kv_cache_spec_kind" => F_KIND,
        b"kv_cache_spec_sliding_window" => F_SLIDING,
        b"locality" => F_LOCALITY,
        b"ownership" => F_OWNERSHIP,
        b"session_id" => F_SESSION,
        b"lookahead_token_ids" => F_LOOKAHEAD,
        b"cache_salt" => F_SALT,
        b"metadata" => F_METADATA,
        b"remaining_copy_counts" => F_COPIES,
        b"reason" => F_REASON,
        b"event_version" => F_VERSION,
        b"token_offset" => F_TOKEN_OFFSET,
        b"block_offsets" => F_BLOCK_OFFSETS,
        _ => return None,
    })
}

/// The field id at array position `i` (≥ 1) of a tagged array event (engine-wire §5.1/§5.2);
/// `c` is at the value there.
///
/// Two positions are told apart by the value's type, because releases that share a prefix of
/// the layout put different things there: store position 7 is vLLM's `lora_name` (str/nil),
/// SGLang's `metadata` (a map) or ROCm ATOM's trailing `token_offset` (an int); removal
/// position 3 is vLLM's `group_idx` (int/nil) or SGLang's proposed `reason` (a str). Read as
/// the wrong one, a well-formed event would fail validation and a removal would be lost.
fn position_id(tag: Tag, i: u32, c: &Cur<'_>) -> Result<u32, DecodeError> {
    Ok(match (tag, i) {
        (Tag::Stored, 7) => match ValueType::at(c)? {
            ValueType::Map => F_METADATA,
            ValueType::Int => F_TOKEN_OFFSET,
            _ => F_LORA_NAME,
        },
        (Tag::Stored, 8) => F_EXTRA,
        (Tag::Stored, 9) => F_GROUP,
        (Tag::Stored, 10) => F_KIND,
        (Tag::Stored, 11) => F_SLIDING,
        (Tag::Stored, i) => i, // 1..=6 match the field ids
        (_, 1) => F_HASHES,
        (_, 2) => F_MEDIUM,
        (Tag::Removed, 3) if ValueType::at(c)? == ValueType::Str => F_REASON,
        _ => F_GROUP,
    })
}

/// The msgpack type of the value `c` is at, as far as [`position_id`] tells positions apart
/// by it (looked at only where it must).
#[derive(Clone, Copy, PartialEq, Eq)]
enum ValueType {
    Map,
    Str,
    Int,
    Other,
}

impl ValueType {
    fn at(c: &Cur<'_>) -> Result<ValueType, DecodeError> {
        Ok(match Marker::from_u8(c.peek()?) {
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => ValueType::Map,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => ValueType::Str,
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64 => ValueType::Int,
            _ => ValueType::Other,
        })
    }
}

impl Decoder {
    /// Counts an event skipped for its tag: `BlockInactive` apart from tags nobody knows.
    fn count_skipped_tag(&mut self, tag: Tag) {
        if tag == Tag::Inactive {
            self.stats.inactive_events += 1;
        } else {
            self.stats.unknown_tags += 1;
        }
    }

    /// Pass 1 over the whole payload (the scratch is already cleared).
    pub(crate) fn parse_batch(&mut self, p: &[u8]) -> Result<BatchPlan, DecodeError> {
        if p.is_empty() {
            return Err(DecodeError::new(K::Empty, 0));
        }
        if p.len() > self.cfg.max_payload {
            return Err(DecodeError::new(
                K::PayloadTooLarge {
                    len: p.len(),
                    limit: self.cfg.max_payload,
                },
                0,
            ));
        }
        let mut c = Cur::new(p, 0);
        let (m, at) = c.marker()?;
        let head = if let Some(n) = c.array_len(m, at)? {
            self.batch_array(&mut c, n, at)?
        } else if let Some(n) = c.map_len(m, at)? {
            self.stats.map_batches += 1;
            self.batch_map(&mut c, n)?
        } else {
            return Err(DecodeError::new(
                K::WrongType {
                    what: "batch",
                    marker: p[0],
                },
                0,
            ));
        };
        let Some(ts) = head.ts else {
            return Err(DecodeError::new(K::MissingField("ts"), 0));
        };
        if c.pos != p.len() {
            self.stats.trailing_bytes += 1;
        }
        self.ts = ts;
        if head.events == 0 {
            self.stats.empty_batches += 1;
        } else if self.recs.is_empty() {
            self.stats.emptied_batches += 1;
        }
        if self.recs.len() > 1 {
            self.stats.split_batches += 1;
        }
        Ok(BatchPlan {
            records: self.recs.len(),
            ts,
            rank: head.rank,
            lost_removals: self.lost_removals,
            signed_hashes: c.signed_hash,
        })
    }

    /// `[ts, events]` or `[ts, events, rank]`, extra elements skipped (the array header, of `n`
    /// elements at `at`, is read).
    fn batch_array(&mut self, c: &mut Cur<'_>, n: u32, at: usize) -> Result<Head, DecodeError> {
        if n < 2 {
            return Err(DecodeError::new(K::BatchTooShort { len: n }, at));
        }
        let mut head = Head {
            ts: Some(read_ts(c)?),
            ..Head::default()
        };
        head.events = self.events(c)?;
        if n >= 3 {
            head.rank = read_rank(c)?;
        }
        for _ in 3..n {
            c.skip_value()?;
            self.stats.unknown_keys += 1;
        }
        Ok(head)
    }

    /// The map form, keyed `ts` / `events` / `data_parallel_rank` | `attn_dp_rank` (the map
    /// header, of `n` pairs, is read).
    fn batch_map(&mut self, c: &mut Cur<'_>, n: u32) -> Result<Head, DecodeError> {
        let mut head = Head::default();
        let mut seen_events = false;
        let mut seen_rank = false;
        for _ in 0..n {
            let (km, kat) = c.marker()?;
            let key = c.str_of(km, kat)?;
            let dup = |what| Err(DecodeError::new(K::DuplicateKey(what), kat));
            match key {
                Some(b"ts") => {
                    if head.ts.is_some() {
                        return dup("ts");
                    }
                    head.ts = Some(read_ts(c)?);
                }
                Some(b"events") => {
                    if seen_events {
                        return dup("events");
                    }
                    seen_events = true;
                    head.events = self.events(c)?;
                }
                Some(b"data_parallel_rank") | Some(b"attn_dp_rank") => {
                    if seen_rank {
                        return dup("rank");
                    }
                    seen_rank = true;
                    head.rank = read_rank(c)?;
                }
                _ => {
                    if key.is_none() {
                        c.pos = kat;
                        c.skip_value()?;
                    }
                    c.skip_value()?;
                    self.stats.unknown_keys += 1;
                }
            }
        }
        if !seen_events {
            return Err(DecodeError::new(K::MissingField("events"), 0));
        }
        Ok(head)
    }

    /// The events array: returns its declared length.
    fn events(&mut self, c: &mut Cur<'_>) -> Result<u64, DecodeError> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => {
                return Err(DecodeError::new(
                    K::WrongType {
                        what: "events",
                        marker: c.buf[at],
                    },
                    at,
                ))
            }
        };
        if n as usize > self.cfg.max_events {
            return Err(DecodeError::new(
                K::TooManyEvents {
                    count: n as u64,
                    limit: self.cfg.max_events,
                },
                at,
            ));
        }
        for _ in 0..n {
            self.event(c)?;
        }
        Ok(n as u64)
    }

    /// One event: parse it, then add it to the plan (validate, filter, measure, pack). Only
    /// structural errors are returned.
    fn event(&mut self, c: &mut Cur<'_>) -> Result<(), DecodeError> {
        let start = c.pos;
        let hmark = self.hashes.len();
        let mut f = Fields::new();
        let (m, at) = c.marker()?;
        let known = if let Some(n) = c.array_len(m, at)? {
            self.event_array(c, n, &mut f)?
        } else if let Some(n) = c.map_len(m, at)? {
            self.event_map(c, n, &mut f)?
        } else {
            c.pos = start;
            c.skip_value()?;
            self.stats.malformed_events += 1;
            false
        };
        if !known {
            self.hashes.truncate(hmark);
            return Ok(());
        }
        let buf = c.buf;
        match f.tag {
            Tag::Stored => self.add_store(buf, &f, hmark),
            Tag::Removed => self.add_removal(buf, &f, hmark),
            _ => self.add_clear(buf, &f, hmark),
        }
        Ok(())
    }

    /// A tagged array event of `n` elements into `f`. Returns false when it was skipped
    /// (counted) for being empty, lacking a string tag, or having an unknown one.
    fn event_array(
        &mut self,
        c: &mut Cur<'_>,
        n: u32,
        f: &mut Fields,
    ) -> Result<bool, DecodeError> {
        if n == 0 {
            self.stats.malformed_events += 1;
            return Ok(false);
        }
        let (tm, tat) = c.marker()?;
        let Some(t) = c.str_of(tm, tat)? else {
            c.pos = tat;
            for _ in 0..n {
                c.skip_value()?;
            }
            self.stats.malformed_events += 1;
            return Ok(false);
        };
        f.tag = tag_of(t);
        if matches!(f.tag, Tag::Unknown | Tag::Inactive) {
            for _ in 1..n {
                c.skip_value()?;
            }
            self.count_skipped_tag(f.tag);
            return Ok(false);
        }
        let max_pos = match f.tag {
            Tag::Stored => 11,
            Tag::Removed => 3,
            _ => 0,
        };
        for i in 1..n {
            if i > max_pos {
                c.skip_value()?;
                self.stats.unknown_keys += 1;
                continue;
            }
            let id = position_id(f.tag, i, c)?;
            self.field(c, id, f)?;
        }
        // array stores shorter than 5 lack required fields: caught by `add_store`
        Ok(true)
    }

    /// A tagged map event of `n` pairs into `f`. Returns false when it was skipped (counted)
    /// for an unknown tag.
    fn event_map(&mut self, c: &mut Cur<'_>, n: u32, f: &mut Fields) -> Result<bool, DecodeError> {
        for _ in 0..n {
            let (km, kat) = c.marker()?;
            let id = match c.str_of(km, kat)? {
                Some(k) => key_id(k),
                None => {
                    c.pos = kat;
                    c.skip_value()?;
                    None
                }
            };
            match id {
                Some(F_TYPE) if f.seen & 1 << F_TYPE == 0 => {
                    f.seen |= 1 << F_TYPE;
                    let vs = c.pos;
                    let (vm, vat) = c.marker()?;
                    match c.str_of(vm, vat)? {
                        Some(t) => f.tag = tag_of(t),
                        None => {
                            c.pos = vs;
                            c.skip_value()?;
                            f.bad(Invalid::Type);
                        }
                    }
                }
                Some(id) if f.seen & (1 << id) == 0 => {
                    f.seen |= 1 << id;
                    self.field(c, id, f)?;
                }
                Some(_) => {
                    // duplicate key
                    c.skip_value()?;
                    f.bad(Invalid::Type);
                }
                None => {
                    c.skip_value()?;
                    self.stats.unknown_keys += 1;
                }
            }
        }
        let allow = match f.tag {
            Tag::Stored => ALLOW_STORED,
            Tag::Removed => ALLOW_REMOVED,
            Tag::Cleared => ALLOW_CLEARED,
            _ => ALLOW_STORED,
        };
        self.stats.unknown_keys += (f.seen & !allow).count_ones() as u64;
        if matches!(f.tag, Tag::Unknown | Tag::Inactive) {
            self.count_skipped_tag(f.tag);
            return Ok(false);
        }
        if f.tag == Tag::Missing {
            f.bad(Invalid::Missing);
        }
        Ok(true)
    }
}

/// The batch-level values besides the events.
#[derive(Default)]
struct Head {
    ts: Option<f64>,
    rank: Option<i64>,
    /// Declared event count.
    events: u64,
}

/// `ts`: float64, float32 or int.
fn read_ts(c: &mut Cur<'_>) -> Result<f64, DecodeError> {
    let (m, at) = c.marker()?;
    match m {
        Marker::F64 => {
            let b = c.take(8)?;
            Ok(f64::from_be_bytes(b.try_into().expect("8 bytes")))
        }
        Marker::F32 => {
            let b = c.take(4)?;
            Ok(f32::from_be_bytes(b.try_into().expect("4 bytes")) as f64)
        }
        _ => match c.int_of(m)? {
            Some(Int::U(v)) => Ok(v as f64),
            Some(Int::I(v)) => Ok(v as f64),
            None => Err(DecodeError::new(
                K::WrongType {
                    what: "ts",
                    marker: c.buf[at],
                },
                at,
            )),
        },
    }
}

/// The batch's rank element: int → Some, anything else → None (skipped).
fn read_rank(c: &mut Cur<'_>) -> Result<Option<i64>, DecodeError> {
    let s = c.pos;
    let (m, _) = c.marker()?;
    if let Some(i) = c.int_of(m)? {
        return Ok(i.as_i64());
    }
    c.pos = s;
    c.skip_value()?;
    Ok(None)
}
