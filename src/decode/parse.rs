//! Pass 1, the msgpack side: walk the batch (array or map form) and each event (tagged array or
//! tagged map) into [`Fields`] — spans into the payload, hashes into the decoder's scratch,
//! tokens measured on the way — then hand each known event to `measure.rs`. Batch-level
//! problems are [`DecodeError`]s; event-level ones are skipped and counted.
use super::error::{DecodeError, DecodeErrorKind as K};
use super::pb::vlen;
use super::reader::{bin_bits, read_token, Cur, Int, INT_SIZE};
use super::scratch::Span;
use super::{BatchPlan, Decoder};
use rmp::Marker;

// Field ids (map keys / array positions).
const F_TYPE: u32 = 0;
const F_HASHES: u32 = 1;
const F_PARENT: u32 = 2;
const F_TOKENS: u32 = 3;
const F_BS: u32 = 4;
const F_LORA_ID: u32 = 5;
const F_MEDIUM: u32 = 6;
const F_LORA_NAME: u32 = 7;
const F_EXTRA: u32 = 8;
const F_GROUP: u32 = 9;
const F_KIND: u32 = 10;
const F_SLIDING: u32 = 11;
const F_LOCALITY: u32 = 12;
const F_OWNERSHIP: u32 = 13;
const F_SESSION: u32 = 14;
const F_LOOKAHEAD: u32 = 15;
const F_SALT: u32 = 16;
const F_METADATA: u32 = 17;

/// Map keys that belong to each event type (others are read but counted as unknown keys).
const ALLOW_STORED: u32 = (1 << 18) - 1;
const ALLOW_REMOVED: u32 =
    1 << F_TYPE | 1 << F_HASHES | 1 << F_MEDIUM | 1 << F_GROUP | 1 << F_LOCALITY | 1 << F_OWNERSHIP;
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
        _ => return None,
    })
}

/// The field id at array position `i` (≥ 1) of a tagged array event (engine-wire §5.1/§5.2);
/// `c` is at the value there.
fn position_id(tag: Tag, i: u32, c: &Cur<'_>) -> Result<u32, DecodeError> {
    Ok(match (tag, i) {
        // `lora_name` when str/nil, SGLang's `metadata` when a map
        (Tag::Stored, 7) => {
            if matches!(
                Marker::from_u8(c.peek()?),
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32
            ) {
                F_METADATA
            } else {
                F_LORA_NAME
            }
        }
        (Tag::Stored, 8) => F_EXTRA,
        (Tag::Stored, 9) => F_GROUP,
        (Tag::Stored, 10) => F_KIND,
        (Tag::Stored, 11) => F_SLIDING,
        (Tag::Stored, i) => i, // 1..=6 match the field ids
        (_, 1) => F_HASHES,
        (_, 2) => F_MEDIUM,
        _ => F_GROUP,
    })
}

/// An event's tag.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Tag {
    Missing,
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Why a known event is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Invalid {
    Type,
    Utf8,
    Missing,
    TooManyBlocks,
}

/// `token_ids` as read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tokens {
    /// Offset of the first element.
    pub(crate) off: u32,
    /// Element count.
    pub(crate) n: u32,
    /// Per-block (offset, packed bytes) measured with the block-size hint: (start in
    /// `Decoder::chunks`, the hint used).
    pub(crate) chunks: Option<(u32, u32)>,
}

/// Fields of one event as parsed (any tag).
pub(crate) struct Fields {
    pub(crate) tag: Tag,
    /// Map keys seen (bit per field id).
    seen: u32,
    /// (start in `Decoder::hashes`, count).
    pub(crate) hashes: Option<(u32, u32)>,
    /// Σ varint sizes of the hashes (packed `block_hashes` of a removal).
    pub(crate) packed: u32,
    pub(crate) parent: Option<i64>,
    pub(crate) tokens: Option<Tokens>,
    pub(crate) bs: Option<u64>,
    pub(crate) lora_id: Option<i64>,
    pub(crate) medium: Option<Span>,
    pub(crate) lora_name: Option<Span>,
    pub(crate) kind: Option<Span>,
    pub(crate) locality: Option<Span>,
    pub(crate) ownership: Option<Span>,
    pub(crate) session: Option<Span>,
    pub(crate) salt: Option<Span>,
    /// Offset of a non-nil `extra_keys` value.
    pub(crate) extra: Option<u32>,
    pub(crate) group: Option<u32>,
    pub(crate) sliding: Option<u32>,
    /// The first reason the event failed validation.
    pub(crate) invalid: Option<Invalid>,
}

impl Fields {
    fn new() -> Self {
        Fields {
            tag: Tag::Missing,
            seen: 0,
            hashes: None,
            packed: 0,
            parent: None,
            tokens: None,
            bs: None,
            lora_id: None,
            medium: None,
            lora_name: None,
            kind: None,
            locality: None,
            ownership: None,
            session: None,
            salt: None,
            extra: None,
            group: None,
            sliding: None,
            invalid: None,
        }
    }
    fn bad(&mut self, why: Invalid) {
        if self.invalid.is_none() {
            self.invalid = Some(why);
        }
    }
}

/// Outcome of a typed field read: `Ok(Err(_))` = semantic mismatch (rewind and skip).
type FR<T> = Result<Result<T, Invalid>, DecodeError>;

#[inline]
fn span(c: &Cur<'_>, s: &[u8]) -> Span {
    Span {
        off: (c.pos - s.len()) as u32,
        len: s.len() as u32,
    }
}

impl Decoder {
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
    /// (counted) for lacking a string tag or having an unknown one.
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
        if f.tag == Tag::Unknown {
            for _ in 1..n {
                c.skip_value()?;
            }
            self.stats.unknown_tags += 1;
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
        if f.tag == Tag::Unknown {
            self.stats.unknown_tags += 1;
            return Ok(false);
        }
        if f.tag == Tag::Missing {
            f.bad(Invalid::Missing);
        }
        Ok(true)
    }

    /// Reads one known field into `f`; a semantic mismatch rewinds, skips and marks `f` invalid.
    fn field(&mut self, c: &mut Cur<'_>, id: u32, f: &mut Fields) -> Result<(), DecodeError> {
        let vs = c.pos;
        let r: Result<(), Invalid> = match id {
            F_HASHES => self.read_hashes(c)?.map(|(h, packed)| {
                f.hashes = Some(h);
                f.packed = packed;
            }),
            F_PARENT => read_opt_hash(c, &mut f.parent)?,
            F_LORA_ID => read_opt_hash(c, &mut f.lora_id)?,
            F_TOKENS => self.read_tokens(c)?.map(|t| f.tokens = Some(t)),
            F_BS => {
                let (m, _) = c.marker()?;
                match c.int_of(m)?.and_then(Int::as_u64) {
                    Some(v) => {
                        f.bs = Some(v);
                        Ok(())
                    }
                    None => Err(Invalid::Type),
                }
            }
            F_MEDIUM => read_opt_str(c, &mut f.medium)?,
            F_LORA_NAME => read_opt_str(c, &mut f.lora_name)?,
            F_KIND => read_opt_str(c, &mut f.kind)?,
            F_LOCALITY => read_opt_str(c, &mut f.locality)?,
            F_OWNERSHIP => read_opt_str(c, &mut f.ownership)?,
            F_SESSION => read_opt_str(c, &mut f.session)?,
            F_SALT => read_opt_str(c, &mut f.salt)?,
            F_GROUP => read_opt_u32(c, &mut f.group)?,
            F_SLIDING => read_opt_u32(c, &mut f.sliding)?,
            F_EXTRA => {
                if c.peek()? != 0xc0 {
                    f.extra = Some(c.pos as u32);
                }
                c.skip_value()?;
                Ok(())
            }
            F_METADATA => self.read_metadata(c, f)?,
            _ => {
                // lookahead_token_ids and anything known-but-unused
                c.skip_value()?;
                Ok(())
            }
        };
        if let Err(why) = r {
            c.pos = vs;
            c.skip_value()?;
            f.bad(why);
        }
        Ok(())
    }

    /// `token_ids`: an array of ints. When the count is a multiple of the block-size hint (the
    /// last pairable store's `block_size`), the per-block (offset, packed bytes) are measured
    /// on the way into `chunks`, so pass 1 walks the tokens once. Without the hint only the
    /// structure is checked here (every element an int, in bounds); the values
    /// (0 ≤ v ≤ u32::MAX) are then checked by the measuring walk, which runs for the stores
    /// that are forwarded with tokens.
    fn read_tokens(&mut self, c: &mut Cur<'_>) -> FR<Tokens> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        let first = c.pos;
        let buf = c.buf;
        let mut pos = first;
        let bs = self.bs_hint as usize;
        if n > 0 && bs > 0 && n as usize % bs == 0 {
            let start = self.chunks.len();
            for _ in 0..n as usize / bs {
                let off = pos;
                let mut tb = 0usize;
                for _ in 0..bs {
                    match read_token(buf, &mut pos) {
                        Some(v) => tb += vlen(v as u64),
                        None => {
                            self.chunks.truncate(start);
                            return Ok(Err(Invalid::Type));
                        }
                    }
                }
                self.chunks.push((off as u32, tb as u32));
            }
            c.pos = pos;
            return Ok(Ok(Tokens {
                off: first as u32,
                n,
                chunks: Some((start as u32, bs as u32)),
            }));
        }
        for _ in 0..n {
            let Some(&b) = buf.get(pos) else {
                return Ok(Err(Invalid::Type));
            };
            let sz = INT_SIZE[b as usize];
            if sz == 0 {
                return Ok(Err(Invalid::Type));
            }
            pos += sz as usize;
        }
        if pos > buf.len() {
            return Ok(Err(Invalid::Type));
        }
        c.pos = pos;
        Ok(Ok(Tokens {
            off: first as u32,
            n,
            chunks: None,
        }))
    }

    /// `block_hashes` into `hashes`: returns ((start, count), Σ varint sizes).
    fn read_hashes(&mut self, c: &mut Cur<'_>) -> FR<((u32, u32), u32)> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        if n as usize > self.cfg.max_blocks_per_event {
            return Ok(Err(Invalid::TooManyBlocks));
        }
        let start = self.hashes.len() as u32;
        let mut packed = 0usize;
        for _ in 0..n {
            let (m, at) = c.marker()?;
            match read_hash_after(c, m, at)? {
                Ok(h) => {
                    packed += vlen(h as u64);
                    self.hashes.push(h);
                }
                Err(e) => {
                    self.hashes.truncate(start as usize);
                    return Ok(Err(e));
                }
            }
        }
        Ok(Ok(((start, n), packed as u32)))
    }

    /// SGLang's `metadata` map: `cache_salt` is lifted, other keys are skipped and counted.
    fn read_metadata(&mut self, c: &mut Cur<'_>, f: &mut Fields) -> FR<()> {
        let (m, at) = c.marker()?;
        if m == Marker::Null {
            return Ok(Ok(()));
        }
        let n = match c.map_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        for _ in 0..n {
            let (km, kat) = c.marker()?;
            match c.str_of(km, kat)? {
                Some(b"cache_salt") => {
                    if let Err(e) = read_opt_str(c, &mut f.salt)? {
                        return Ok(Err(e));
                    }
                }
                k => {
                    if k.is_none() {
                        c.pos = kat;
                        c.skip_value()?;
                    }
                    c.skip_value()?;
                    self.stats.unknown_keys += 1;
                }
            }
        }
        Ok(Ok(()))
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

/// A string (UTF-8-checked); nil → None.
#[inline]
fn read_opt_str(c: &mut Cur<'_>, out: &mut Option<Span>) -> FR<()> {
    let (m, at) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    match c.str_of(m, at)? {
        Some(s) => {
            if !s.is_ascii() && std::str::from_utf8(s).is_err() {
                return Ok(Err(Invalid::Utf8));
            }
            *out = Some(span(c, s));
            Ok(Ok(()))
        }
        None => Ok(Err(Invalid::Type)),
    }
}

/// A hash / lora_id: int (low 64 bits) or bin (last 8 bytes BE, len ≥ 1); nil → None.
#[inline]
fn read_opt_hash(c: &mut Cur<'_>, out: &mut Option<i64>) -> FR<()> {
    let (m, at) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    Ok(read_hash_after(c, m, at)?.map(|h| *out = Some(h)))
}

/// A hash whose marker `m` (at `at`) is read.
#[inline]
fn read_hash_after(c: &mut Cur<'_>, m: Marker, at: usize) -> FR<i64> {
    if let Some(i) = c.int_of(m)? {
        return Ok(Ok(i.bits() as i64));
    }
    match c.bin_of(m, at)? {
        Some(b) if !b.is_empty() => Ok(Ok(bin_bits(b) as i64)),
        _ => Ok(Err(Invalid::Type)),
    }
}

/// A u32 (any int width, value in range); nil → None.
#[inline]
fn read_opt_u32(c: &mut Cur<'_>, out: &mut Option<u32>) -> FR<()> {
    let (m, _) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    match c.int_of(m)?.and_then(Int::as_u64) {
        Some(v) if v <= u32::MAX as u64 => {
            *out = Some(v as u32);
            Ok(Ok(()))
        }
        _ => Ok(Err(Invalid::Type)),
    }
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
